"""Files the CLI writes for the user: the starter inventories of `eltctl init` (starter.toml, short, for this
machine; hosts.example.toml, the reference, with `--full`)."""
