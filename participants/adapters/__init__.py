"""Adapters: third-party agent frameworks on the session API or the gateway, each a small module
that imports its framework only when called (so it runs in the framework's own environment).

- :mod:`.verifiers`: a verifiers 0.4.0 environment, unmodified, with its client pointed at the gateway.
- :mod:`.nemo_gym`: NeMo Gym's agents and resources servers behind the gateway (URLs and ids).
- :mod:`.verl`: verl's ``AgentLoopBase`` whose model calls go through a rollout session.
"""
