"""The PostgreSQL request store: several collector replicas write one database and every
replica's API, UI and CLI read the same answers from it (``store.py``, ``reads.py``)."""
