"""Command-line flags of `tokenmill serve` (besides the engine's)."""

from __future__ import annotations

import argparse

from tokenmill.server.reasoning import PARSERS


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (also $TOKENMILL_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model name clients use (default: the model's)")
    g.add_argument("--max-queued-requests", type=int, default=256,
                   help="waiting requests beyond which new ones get 429 (default 256)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may finish after SIGTERM before they are aborted")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body (default 4 MiB)")
    g.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a request's headers, and then its body, may take to arrive before a 408 "
                        "(default 30)")
    g.add_argument("--max-connections", type=int, default=1024,
                   help="open connections beyond which a new one closes the connection idle the longest, or, "
                        "where none is idle, gets 503 and is closed (default 1024)")
    g.add_argument("--keep-alive-timeout", type=float, default=120.0,
                   help="seconds an idle kept-alive connection stays open; longer than clients keep idle "
                        "connections in their pools (httpx and the openai client 5, aiohttp 15, Go 90), so that "
                        "the client closes first and never sends a request on a connection being closed "
                        "(default 120)")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: the context length)")
    g.add_argument("--allow-request-chat-template", action="store_true",
                   help="accept a chat_template sent in a request (rendered in a sandbox)")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="how the model writes tool calls (default: from its chat template, else hermes)")
    g.add_argument("--reasoning-parser", default="auto", choices=PARSERS,
                   help="return the model's reasoning as reasoning_content, apart from content: deepseek_r1 and "
                        "qwen3 read <think>...</think>, openai_gptoss the harmony format's channels (gpt-oss); "
                        "auto picks from the chat template; none returns the raw text (default auto)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each a process with its own KV cache and CPU threads / N, behind this "
                        "server, which routes each request to one of them (default 1: no replicas, one engine)")
    g.add_argument("--router", default="prefix", choices=["prefix", "round_robin"],
                   help="with --data-parallel-size > 1: prefix sends a request to the replica that most likely "
                        "holds its longest prompt prefix in its cache (fewest requests in flight on a tie); "
                        "round_robin: each replica in turn (default: prefix)")
    g.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                   help="with --data-parallel-size > 1: mp starts the replicas as processes on this machine; ray "
                        "places them on the nodes of a Ray cluster (--ray-address), each listening on its node's "
                        "address (every node must be able to load the model) (default: mp)")
    g.add_argument("--ray-address", default=None,
                   help="with --distributed-executor-backend ray: the cluster to join (auto: the one this machine "
                        "belongs to; default: a Ray instance started on this machine)")
    g.add_argument("--replica-hang-timeout", type=float, default=60.0,
                   help="with --data-parallel-size > 1: a replica that answers no health probe for this many "
                        "seconds (alive but stopped or deadlocked) is killed, failing its requests, and restarted "
                        "(default 60; 0: never)")
    g.add_argument("--log-level", default="info", help="debug | info | warning | error")
