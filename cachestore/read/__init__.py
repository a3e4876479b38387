"""Reading a committed generation: :class:`~.reader.Reader`, a map-style dataset over one
generation of any store."""
