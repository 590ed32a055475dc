"""``stalwart drill``: a fault drill users run against their own job (see :mod:`.session` and :mod:`.core`)."""
