"""The serving runtime: real replicas behind HTTP, as ``serve``, ``serve --replicas`` and
``run-real --replicas`` run them, and the Python API's ``schedlab.serve`` and
``schedlab.run_real(..., replicas=N)``.

- ``http``: what the replica's server and the front share (``APIError``, the FastAPI app, uvicorn's
  configuration);
- ``params``, ``server``, ``bridge``, ``metrics``: one replica's OpenAI-compatible server (requests
  checked, submitted to the replica's live arrival source, tokens handed back from its thread,
  ``/metrics``);
- ``single``: one replica served (the engine's loop in the main thread, the server in another);
- ``replicas``: the replica processes a front starts, owned by the process that starts them, and
  the replicas at URLs it routes to without owning them (``serve --replica-url``);
- ``ray_replicas``: replicas started as Ray actors (``--executor ray``), reached by URL, owned;
- ``front``: the front that routes each request with the simulator's routers;
- ``cluster``: replicas and front together (``serve_cluster``, ``run_real_cluster``);
  ``record``: what a cluster writes.

Its place in the layers (``tests/test_layering.py``): above the engine, below the API. It runs
what it is handed (a loaded engine and a policy object, or the ``schedlab serve`` options each
replica process starts with) and never imports the API: the API builds those from its options
and calls it (``schedlab.serve``, ``run_real(replicas=...)``), and so do the commands, through
the API or directly. A replica process it starts runs the ``schedlab serve`` command: a process,
not an import.
"""
