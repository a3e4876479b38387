"""Writing a generation: the owner's writer and the tickets it hands to other processes
(:mod:`.writer`), the claim protocol every sample goes through (:mod:`.sink`), and one generation
written by several processes together (:mod:`.shared`)."""
