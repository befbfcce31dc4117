"""Small helpers with no knowledge of pools or ranks: free ports (``net``), atomic file writes
(``atomic``), entry-point plugin maps (``plugins``)."""
