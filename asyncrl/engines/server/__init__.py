"""The SGLang-compatible HTTP server around an engine.

``app`` (the aiohttp application, its traffic gate and ``/generate``), ``control_routes``
(SGLang's control and weight routes), ``openai_routes`` (``/v1``), ``generate_wire`` (body
parsing, reply formatting, error shapes), ``tool_stream`` (streamed tool calls),
``in_process`` (``/generate`` called directly by a workflow in the same process).
"""
