"""servewatch: diagnostics agent for GPU inference servers.

This package stays import-light: ``agent.sdk`` runs inside inference servers and must not pull
the agent side (anyio, httpx, OTel SDK) in.
"""

__version__ = "0.1.0"
