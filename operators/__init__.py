"""The elastic Kubernetes operator (Kopf): custom resources in, controller ticks out.

``operators.main`` holds the Kopf handlers (run with ``kopf run -m operators.main -A --standalone``
or ``elastic operator``); ``operators.runtime`` the registered resources and one controller per
GPUPool; ``operators.status`` conditions and ``events.k8s.io/v1`` Events.
"""
