"""Names shared by the store tests and their fixtures."""

REPO_ID = "tiny-org/tiny-llama"
