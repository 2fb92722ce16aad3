"""Data shipped with the rollout package: math problems and the retrieval corpus."""
