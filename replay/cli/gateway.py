"""``rollout-journal gateway``: the OpenAI-compatible journaling gateway (a live command: offline
replay never imports it)."""

from __future__ import annotations

import argparse

from rollout_journal.replay.exit_codes import EXIT_OK

DESCRIPTION = """\
An OpenAI-compatible server in front of a vLLM server that journals every model and tool call of
every rollout, so a crashed agent job that is restarted gets each call it already made answered
from the journal (none regenerated), and goes live from the first call past it.

Give each rollout's agent the base URL http://HOST:PORT/r/<rollout_id>/v1 (any OpenAI client works
unmodified), or send X-Rollout-Id. Tool servers speaking NeMo Gym's resources-server protocol go
behind http://HOST:PORT/r/<rollout_id>/tools/<name> with --tools name=URL.
  rollout-journal gateway --upstream http://127.0.0.1:8000 --journal runs/gw --port 8100
  rollout-journal gateway --upstream http://127.0.0.1:8000 --journal kafka://host:9092/ns \\
      --tools counter=http://127.0.0.1:9000,recovery=event_sourced

Several gateways on one Kafka namespace (one per agent host): start each with --ownership group.
Each joins the namespace's consumer group and writes only the rollouts of the partitions the group
assigns it; a request for another gateway's rollout is forwarded to it (its --advertise URL), and a
killed gateway's rollouts move to the others after the group's session timeout.
  rollout-journal gateway --upstream http://127.0.0.1:8000 --journal kafka://host:9092/ns \\
      --ownership group --host 0.0.0.0 --advertise http://agent-host-3:8100
Prints 'serving gateway at URL' once it listens; stops on SIGINT or SIGTERM.
"""


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gateway",
        help="an OpenAI-compatible gateway that journals every call (Chat Completions, Responses, tools)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--upstream", required=True, help="the vLLM server's base URL (http://host:port or .../v1)")
    p.add_argument("--journal", required=True, help="a directory, or kafka://host:port/namespace")
    p.add_argument("--port", type=int, default=8100, help="port (default 8100; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--model-dir", help="the served model's folder (default: the folder the upstream names)")
    p.add_argument(
        "--upstream-api",
        choices=["auto", "generate", "completions"],
        default="auto",
        help="tokens-in endpoint: vLLM's /inference/v1/generate (needs --enable-scale-out), /v1/completions, "
        "or auto (generate when served)",
    )
    p.add_argument(
        "--upstream-logprobs",
        choices=["probe", "processed", "raw"],
        default="probe",
        help="what the upstream's logprobs are: probe asks it and refuses raw ones (default); processed "
        "(vllm serve --logprobs-mode processed_logprobs) or raw says so without asking",
    )
    p.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="NAME=URL[,recovery=MODE]",
        help="a NeMo Gym resources server; MODE event_sourced (default), restart_only or stateless",
    )
    p.add_argument(
        "--ng-resources",
        metavar="NAME",
        help="the --tools server that NeMo Gym's /ng-rollout/<id>/<route> resources calls go to",
    )
    p.add_argument("--require-open", action="store_true", help="refuse rollouts not opened with POST /r/<id>/open")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (default 8 MiB)")
    p.add_argument(
        "--writer",
        help="writer name in the events: a Kafka namespace's writer slot (default gateway); with --ownership "
        "group this member's name (default gateway-<host>-<pid>)",
    )
    p.add_argument(
        "--ownership",
        choices=["single", "group"],
        default="single",
        help="single: this gateway writes the whole journal (a second one on a Kafka namespace fences it; "
        "default); group: one of several gateways on a Kafka namespace, each writing the partitions its "
        "consumer group assigns it",
    )
    p.add_argument(
        "--advertise",
        metavar="URL",
        help="with --ownership group: the base URL other gateways forward this one's rollouts to "
        "(default: the address it listens on)",
    )
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a request that names none")
    p.add_argument("--upstream-retries", type=int, default=3, help="retries of a refused or unreachable upstream")
    p.add_argument(
        "--tool-timeout-s",
        type=float,
        default=300.0,
        help="a tool server that has not answered a call by then is taken as gone: the rollout's session "
        "there is rebuilt from the journal and the call made again (default: 300)",
    )
    p.add_argument(
        "--progress-every-tokens", type=int, default=0, help="journal a long call's progress every N tokens (0: off)"
    )
    p.add_argument(
        "--no-finish-on-verify", action="store_true", help="a tool server's /verify does not finish the rollout"
    )
    p.set_defaults(run="gateway:run")  # imported when the command runs


def run(args: argparse.Namespace) -> int:
    from rollout_journal.participants.remote.gateway import GatewayConfig, serve_gateway

    config = GatewayConfig(
        upstream=args.upstream,
        journal=args.journal,
        model_dir=args.model_dir,
        host=args.host,
        port=args.port,
        upstream_api=args.upstream_api,
        upstream_logprobs=args.upstream_logprobs,
        tools=args.tools,
        require_open=args.require_open,
        max_body_bytes=args.max_body_bytes,
        writer=args.writer,
        ownership=args.ownership,
        advertise=args.advertise,
        default_max_tokens=args.default_max_tokens,
        upstream_retries=args.upstream_retries,
        tool_timeout_s=args.tool_timeout_s,
        progress_every_tokens=args.progress_every_tokens,
        finish_on_verify=not args.no_finish_on_verify,
        ng_resources=args.ng_resources,
    )
    serve_gateway(config, ready=lambda url: print(f"serving gateway at {url}", flush=True))
    return EXIT_OK
