"""Chat: the model's chat template rendered in a sandbox under bounds (``_template``, ``_sandbox``)
and the tool formats (``_tools``: the tools a request gives, the calls parsed from a reply).
Knows no engine; ``Engine.chat`` and the server call it.
"""
