"""Generation engines: the SGLang-API client, the CPU engine server, and the engine launcher (docs/engines.md).

- `client.EngineClient`: async client for SGLang's native HTTP API (real SGLang and the CPU engine).
- `cpu_server`: the project's CPU engine speaking the same API (`python -m miles_core.engines.cpu_server`).
- `launcher.EngineFleet`: engine processes as Ray actors, health-checked and restarted when they die.

Importing this package imports neither torch nor ray; import the submodules you need.
"""
