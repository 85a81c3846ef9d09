"""The engine: native build, ctypes bindings, engine worker, scheduler and engine clients.

Layers above (HTTP front end, protocol adapters, control API) talk to it only through
:class:`ostinatod.engine.types.EngineClient` and the request/event types in that module.
"""
