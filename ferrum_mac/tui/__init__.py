"""`ferrum-chat`: the Textual chat application.

    app.py              ChatApp: the engine, the history, the resident conversations, palette commands
    services.py         what the UI asks of the world: open an engine, list and pull models, machine facts
    chat_turn.py        one answer in a worker thread: engine events -> batched UI messages
    resident.py         an LRU of engine conversations that keep their KV cache within a token budget
    chat_settings.py    a conversation's stored settings <-> the engine's ChatSettings
    export.py           a conversation as Markdown
    messages.py         the app's custom Textual messages
    screens/            one screen per file, each with its own .tcss
    widgets/            one widget per file

The UI never touches a model. From an engine it uses only the surface `ChatEngine` declares
(ferrum_mac/engine/surface.py): `name`, `default_sampling`,
`settings(**changes)`, `conversation(settings, prepare=False)`, `kv_capacity()`, `cancel()`,
`close()`; from a conversation: `messages`, `ledger`, `settings`, `send(text, cancel)`, `close()`.
"""
