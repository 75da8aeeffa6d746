"""`gpupool user add | remove | token`: principals, as an operator (list is a read: agents/cli/views.py)."""
from __future__ import annotations

import asyncio

from agents.client import Client
from infra import security


def cmd_user_change(cfg, args) -> int:
    """SCRAM credentials and ACLs on the broker, a registry record, and (for this CLI) the credentials stored under
    $GPUPOOL_HOME/credentials, mode 0600."""
    from infra import principals

    if not args.name:
        raise SystemExit(f"user {args.action} needs a NAME")
    if args.action == "token":
        return _print_token(cfg, args.name)
    c = Client(cfg)
    if args.action == "remove":
        n = asyncio.run(principals.remove(c.conn(), args.name))
        security.forget(cfg.home, args.name)
        print(f"removed {args.name} ({n} ACLs)")
        return 0
    if not args.role:
        if args.show_token and security.stored(cfg.home, args.name) is not None:
            return _print_token(cfg, args.name)  # `user add NAME --show-token` of a user already added
        raise SystemExit(f"user add needs --role ({', '.join(security.ROLES)})")
    creds = security.new_credentials(args.name, args.role, args.tenant, getattr(args, "node", None) or (),
                                     getattr(args, "auto_admit", False))
    asyncio.run(principals.add(c.conn(), creds))
    path = security.save(cfg.home, creds)
    what = (f" of {creds.tenant}" if creds.tenant else "") + (
        f" for {', '.join(creds.nodes)}{', auto-admitted' if creds.auto_admit else ''}" if creds.nodes else "")
    print(f"added {creds.name} ({creds.role}{what}); credentials in {path}")
    if args.show_token:
        print(f"HTTP token: {creds.token}")
    return 0


def _print_token(cfg, name: str) -> int:
    """The HTTP token of a principal whose credentials this CLI's home holds (the ones `user add` wrote, and the
    stack's own `admin` and `service`): what the dashboard's sign-in and Prometheus' scrape take."""
    creds = security.stored(cfg.home, name)
    if creds is None:
        raise SystemExit(f"no credentials for {name!r} in {security.credentials_dir(cfg.home)}: only the CLI that "
                         f"added a principal holds its token (gpupool user add {name} --role ROLE)")
    print(creds.token)
    return 0
