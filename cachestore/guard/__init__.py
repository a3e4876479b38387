"""Defending a store against what is on disk and whoever else uses it: opening only the store's own
regular files, never through a link (:mod:`.safefs`); whose files a job takes as its own
(:mod:`.trust`); the strict parsers of every file read back (:mod:`.untrusted`); and the locks that
die with their process: the writer lock (:mod:`.locking`) and a lock per sample of a generation
written together (:mod:`.claims`). See docs/ARCHITECTURE.md, "Untrusted stores"."""
