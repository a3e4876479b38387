"""The format of a record: a sample as a structure and leaves (:mod:`.codec`, :mod:`.named`), the
strict parser of a structure read back (:mod:`.structure`), its bytes (:mod:`.records`), their
checksums (:mod:`.checksums`, with the compiled gather of :mod:`.native`), and the default collate
(:mod:`.collate`). No file is opened here: the backends store and find the bytes."""
