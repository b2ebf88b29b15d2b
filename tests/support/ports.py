"""One helper for a free TCP port on the loopback interface."""
import socket


def free_port() -> int:
    """A port nobody listens on right now (the OS picks it); for servers that must be restarted on
    the same port or told their port up front. Prefer port 0 where the server reports its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
