"""The chat screen's jobs, one collaborator each: `ChatScreen` keeps the widgets, keys and handlers and delegates."""
