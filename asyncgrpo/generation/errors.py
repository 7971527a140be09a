"""What can go wrong talking to a vLLM server, as the client raises it (generation/client.py says
which failures are retried and for how long)."""

from __future__ import annotations


class VLLMError(RuntimeError):
    """A vLLM server could not do what was asked."""


class VLLMRequestError(VLLMError):
    """The server rejected a request (4xx): retrying would not help."""

    def __init__(self, url: str, status: int, server_message: str):
        self.url, self.status, self.server_message = url, status, server_message
        super().__init__(f"vLLM server rejected {url} with HTTP {status}: {server_message}")


class VLLMUnavailableError(VLLMError):
    """The server did not answer usefully within the time allowed."""


class VLLMAuthenticationError(VLLMError):
    """The server wants an API key this client does not send (HTTP 401). Not a `VLLMRequestError`:
    callers that read a 4xx as "route missing" must not take a refused key for that."""


class VLLMServerLostError(VLLMUnavailableError):
    """A server stopped serving: it refused or dropped the connection, or its engine died."""

    def __init__(self, url: str, message: str):
        self.url = url
        super().__init__(message)
