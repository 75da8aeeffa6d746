"""`gpupool user add | remove`: principals, as an operator (list is a read: agents/cli/views.py)."""
from __future__ import annotations

import asyncio

from agents.client import Client
from infra import security


def cmd_user_change(cfg, args) -> int:
    """SCRAM credentials and ACLs on the broker, a registry record, and (for this CLI) the credentials stored under
    $GPUPOOL_HOME/credentials, mode 0600."""
    from infra import principals

    c = Client(cfg)
    if not args.name:
        raise SystemExit(f"user {args.action} needs a NAME")
    if args.action == "remove":
        n = asyncio.run(principals.remove(c.conn(), args.name))
        security.forget(cfg.home, args.name)
        print(f"removed {args.name} ({n} ACLs)")
        return 0
    if not args.role:
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
