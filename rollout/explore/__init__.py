"""``rollout-tracer explore``: a local, read-only web app over the export's Parquet tables
(DuckDB for filters, sorting and paging; tantivy for search inside messages)."""
