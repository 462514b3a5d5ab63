"""Glue between hf_paged and the outside world: model families, generate and pipeline hooks."""
