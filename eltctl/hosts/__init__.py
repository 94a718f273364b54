"""The hosts: how the control side reaches them and what it does there.

- `transport`: the `Transport` contract (run a command, open a byte stream), `RunResult`,
  `ErrorKind`, `wrap_env` (the host's env values on stdin); no implementation;
- `local`: `LocalTransport` (`address = "local"`);
- `ssh`: `SSHTransport`, `connect`, host-key handling (the only module that imports asyncssh);
- `fleet`: `Fleet` and `Outcome` (many hosts at once), `open_transport` (picks local or SSH);
- `layout`: where things are on a host (`~/.eltctl/jobs/<job>/<host>/...`), `HostPaths`;
- `ops`: the operations on one host (ship the runtime, sync code, start the daemon,
  list and kill the job's processes);
- `ignore`: what of the job's workdir goes to the hosts (gitignore patterns; one pure decision);
- `programs/`: the stdlib-only Python programs run on the hosts, shipped by `programs.command`.

Nothing is re-exported here, so importing one module never pulls in the others
(`eltctl --help` stays fast).
"""
