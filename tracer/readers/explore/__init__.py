"""``rollout-tracer explore``: a local, read-only web app over the export's Parquet tables
(DuckDB for filters, sorting and paging; tantivy for search inside messages).

A reader like the others: it reads an export's files and nothing of the tracer's writers; the
command line that exports a store first and starts the server is rollout/explore_cli.py."""
