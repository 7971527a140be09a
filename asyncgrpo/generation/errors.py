"""What can go wrong talking to a vLLM server, as the client raises it (generation/client.py says
which failures are retried and for how long)."""

from __future__ import annotations

from asyncgrpo.errors import ServerError


class VLLMError(ServerError):
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


class ServerLostError(VLLMUnavailableError):
    """A vLLM server is lost to the run (docs/reliability.md, "Elastic servers"): the one type for
    every way of losing one, told apart by what it carries.

    `url`: the server; None when the run has lost more of its servers than it may, and `lost` names
    them. `weights_lost`: the server answered, but with weights the trainer did not push (it restarted
    from its checkpoint): it is avoided until the trainer pushes the weights again, and the rollout
    starts anew on another. `run_can_go_on`: False when the run has lost more servers than it may and
    stops; True when the others carry it (a lost server costs its share of generation)."""

    def __init__(
        self,
        message: str,
        url: str | None = None,
        *,
        weights_lost: bool = False,
        run_can_go_on: bool = True,
        lost: tuple[str, ...] = (),
    ):
        super().__init__(message)
        self.url, self.weights_lost, self.run_can_go_on = url, weights_lost, run_can_go_on
        self.lost = lost or ((url,) if url else ())


# The name the client exported before there was one lost-server type; code that catches it goes on working.
VLLMServerLostError = ServerLostError


class MalformedResponseError(ServerError, ValueError):
    """The server answered 200 with a body that lacks what was asked for."""
