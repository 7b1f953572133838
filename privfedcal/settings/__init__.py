"""A run's settings: their descriptions, the run's config and the sections each floor receives, and the catalogue every flag, settings-file key and docs table is derived from."""
