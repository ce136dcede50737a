"""``tangramd http``: an HTTP gateway that makes tangram a drop-in for RL stacks' sandboxes.

SandboxFusion's ``POST /run_code``, SWE-ReX's remote runtime at ``/swerex/{env}`` and
Prometheus ``GET /metrics``, in front of a running ``tangramd up`` (see ``app.py``). Needs
the optional extra ``arl-tangram[http]`` (FastAPI, uvicorn with httptools and uvloop,
prometheus-client).
"""
