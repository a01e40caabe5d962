"""One screen per file, each with its own .tcss beside it."""
