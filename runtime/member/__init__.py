"""One member's life in the job: the pure plan of a generation (`plan`: propose,
roll call, choose a source), the generation state machine (`generation`), the
out-of-band control thread (`control`), one process group per generation and
abortable collectives (`collectives`), the quick exit (`exiting`), the
`MemberSession` that the training job and restart mode's supervisor share
(`session`: store, store loss, control thread, admission, the generation's
views), its `Reporter` (`report`: status, events, checkpoint announcements) and
how members move bytes and state to each other (`transfer`).

`plan` is standard library only (the package's top imports it); the rest needs torch.
"""
