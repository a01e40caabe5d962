"""The model store: where models live on disk and how bundled ones are fetched."""
