"""The request store on SQLite: the file's schema, the writer with its retention and WAL
checkpoints, the reads, and the request list's query planner.

Everything here is specific to SQLite; what any store backend shares (the row and its
documents, the list's query, the errors and metadata) is in the parent package.
"""
