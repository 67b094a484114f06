"""Session scripts: ``operate-sidecar replay`` (:mod:`.runner`, patterns in :mod:`.matcher`)
and ``operate-sidecar --record`` (:mod:`.recorder`). Imported only by those commands."""
