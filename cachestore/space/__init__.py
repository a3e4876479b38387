"""Room to work in: byte sizes, allocated blocks and free space (:mod:`.disk`), the memory this
process may fill (:mod:`.room`), the bytes a generation may take (:mod:`.budget`), and the scratch
names live processes own under a prefix (:mod:`.scratch`)."""
