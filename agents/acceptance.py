"""`gpupool acceptance report --out DIR`: seed 004's acceptance groups as a report a buyer reads.

It runs the four suites of tests/acceptance against a live stack of their own (or reads the results of their last
run, `--results FILE`), and writes DIR/index.html: one section per group, each check with the seed's question it
answers, pass or fail, and its evidence (tables of events and rows, figures as PNG); and the seed's eight buyer's
questions (八问), each answered by links to the checks that prove it. "The platform supports it" is no evidence
(没有证据，不能用一句"平台支持"替代验收): every answer points at a check that ran and at what it saw.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GROUPS = {
    1: ("第一组：资源发现和组织", "Discovery and organisation",
        "准备至少两个资源池或两类资源标签，验证节点上线、维护、异常和重新可用时，平台状态是否准确。任务提交时检查调度器是否根据资源"
        "条件选对池，而不是由用户手工指定机器。"),
    2: ("第二组：单卡边界和共享行为", "Single-card boundary and sharing",
        "在同一设备或同一资源池内提交多个任务，观察资源单元是否按照约定分配。测试资源不足、超额申请、持续运行、主动取消和再次分配，"
        "记录平台状态与实际任务行为是否一致。"),
    3: ("第三组：故障与恢复", "Fault and recovery",
        "分别模拟任务失败、节点重启、设备不可用和调度器短暂异常，确认哪些任务受影响、是否需要人工干预、队列顺序是否改变，以及切分"
        "单元是否被正确释放。对在线服务，还要把流量、重试和副本策略一起纳入验证。"),
    4: ("第四组：治理证据", "Governance evidence",
        "核对任务、资源、租户、权限、队列、配额、操作人和时间线能否关联。若成本分摊或合规审计是采购条件，还要确认平台能否导出足以"
        "支撑复核的记录。"),
}

EIGHT = [
    ("资源池能否区分不同设备、网络、存储和运行环境？",
     "Can the pool tell apart devices, networks, storage and runtime environments?"),
    ("调度器能否根据任务需要选择完整 GPU、切分单元或其他资源组合？",
     "Does the scheduler choose whole GPUs, slices or combinations from what the job needs?"),
    ("资源池、设备、切分单元和任务是否有稳定的唯一标识？",
     "Do pools, devices, slices and jobs have stable unique identifiers?"),
    ("租户、项目、队列和配额能否与资源分配记录关联？",
     "Can tenants, projects, queues and quotas be linked to the allocation records?"),
    ("任务取消、失败、超时和节点维护后，资源如何回收？",
     "How are resources reclaimed after cancel, failure, timeout and node maintenance?"),
    ("一个切分单元异常时，同卡其他任务的影响范围如何证明？",
     "When one slice fails, how is the effect on the other jobs of the card shown?"),
    ("设备或运行时升级后，历史任务和资源账目是否还能追溯？",
     "After a device or runtime upgrade, can past jobs and the resource accounts still be traced?"),
    ("平台能否导出资源、任务、权限、审计和故障证据供采购复核？",
     "Can the platform export resource, job, permission, audit and fault evidence for review?"),
]

REPO = Path(__file__).resolve().parent.parent
SUITES = REPO / "tests" / "acceptance"


def run_suites(results: Path, extra: list[str] = ()) -> int:
    """Run tests/acceptance (pytest, a stack of its own); the results land in `results`."""
    if not SUITES.is_dir():
        raise SystemExit(f"the acceptance suites are not here ({SUITES}): run from a source checkout, or pass "
                         f"--results FILE of an earlier run")
    env = {**os.environ, "GPUPOOL_ACCEPTANCE_OUT": str(results)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITES), *extra],
                          env=env, cwd=REPO).returncode


# ---------------------------------------------------------------- the report


def _figure(out: Path, name: str, item: dict) -> str | None:
    """A PNG of a series (x, y[, label]): a step chart over time or a bar chart of labelled values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = item["points"]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 2.8), dpi=110)
    if isinstance(pts[0][0], str):
        ax.bar([str(p[0]) for p in pts], [p[1] for p in pts], color="#4a7ab5")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    else:
        t0 = pts[0][0]
        ax.step([(p[0] - t0) / 1000 for p in pts], [p[1] for p in pts], where="post", color="#4a7ab5")
        ax.set_xlabel("seconds")
        for p in pts:
            if len(p) > 2 and p[2]:
                ax.annotate(str(p[2]), ((p[0] - t0) / 1000, p[1]), fontsize=7, rotation=30,
                            xytext=(2, 4), textcoords="offset points")
    ax.set_title(item["title"], fontsize=9)
    ax.set_ylabel(item["name"], fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path.name


def _item_html(out: Path, anchor: str, k: int, item: dict) -> str:
    esc = html.escape
    if item["type"] == "note":
        return f"<p class='note'>{esc(item['text'])}</p>"
    if item["type"] == "table":
        head = "".join(f"<th>{esc(str(c))}</th>" for c in item["columns"])
        body = "".join("<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in r) + "</tr>" for r in item["rows"][:60])
        more = f"<p class='more'>... {len(item['rows']) - 60} more rows</p>" if len(item["rows"]) > 60 else ""
        return f"<h5>{esc(item['title'])}</h5><table><tr>{head}</tr>{body}</table>{more}"
    if item["type"] == "events":
        rows = "".join(f"<tr><td>{esc(str(e.get('at', '')))}</td><td>{esc(str(e.get('kind', '')))}</td>"
                       f"<td>{esc(str(e.get('node', '')))}</td><td>{esc(str(e.get('what', '')))}</td></tr>"
                       for e in item["events"][:80])
        return (f"<h5>{esc(item['title'])}</h5><table><tr><th>at</th><th>event</th><th>node</th><th>what</th></tr>"
                f"{rows}</table>")
    if item["type"] == "series":
        png = _figure(out, f"{anchor}-{k}", item)
        return f"<img src='{png}' alt='{esc(item['title'])}'>" if png else ""
    return ""


CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.6em}h2{border-bottom:2px solid #ccc;padding-top:1em}h3{margin-bottom:.2em}
.pass{color:#1a7f37;font-weight:600}.fail{color:#c62828;font-weight:600}.q{color:#555;margin:.2em 0 .6em}
table{border-collapse:collapse;margin:.3em 0 1em;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f4f4f4}.check{border-left:4px solid #ddd;padding-left:1em;
margin:1.2em 0}.check.ok{border-color:#1a7f37}.check.bad{border-color:#c62828}.note{background:#f8f8f0;
padding:.3em .6em}pre{white-space:pre-wrap;font-size:11px;background:#fff4f4;padding:.5em}img{max-width:100%}"""


def render(doc: dict, out: Path) -> Path:
    """index.html (and its PNGs) from the suites' results."""
    esc = html.escape
    out.mkdir(parents=True, exist_ok=True)
    results = doc["results"]
    passed = sum(1 for r in results if r["outcome"] == "passed")
    parts = [f"<!doctype html><meta charset='utf-8'><title>gpupool acceptance report</title><style>{CSS}</style>",
             "<h1>gpupool: acceptance report (seed 004: 池化与切分的验收)</h1>",
             f"<p>{passed} of {len(results)} checks passed; run finished {esc(doc.get('finished_at', ''))} on a live "
             f"stack (a real Kafka broker with SASL and ACLs, the worker, simulated node agents). Each check says "
             f"which question of the seed it answers and shows what it saw.</p>"]
    parts.append("<h2 id='eight'>八问 — the eight buyer's questions</h2><table><tr><th>#</th><th>question</th>"
                 "<th>answered by</th></tr>")
    for i, (zh, en) in enumerate(EIGHT, 1):
        proofs = [r for r in results if i in r["eight"]]
        links = ", ".join(f"<a href='#{esc(r['name'])}' class='{'pass' if r['outcome'] == 'passed' else 'fail'}'>"
                          f"{esc(r['name'])}</a>" for r in proofs) or "<span class='fail'>no check</span>"
        parts.append(f"<tr><td>{i}</td><td>{esc(zh)}<br><small>{esc(en)}</small></td><td>{links}</td></tr>")
    parts.append("</table>")
    for g, (zh, en, ask) in GROUPS.items():
        mine = [r for r in results if r["group"] == g]
        ok = sum(1 for r in mine if r["outcome"] == "passed")
        parts.append(f"<h2 id='group{g}'>{esc(zh)} — {esc(en)} ({ok}/{len(mine)})</h2><p class='q'>{esc(ask)}</p>")
        for r in mine:
            good = r["outcome"] == "passed"
            parts.append(f"<div class='check {'ok' if good else 'bad'}' id='{esc(r['name'])}'>"
                         f"<h3>{esc(r['name'])} <span class='{'pass' if good else 'fail'}'>"
                         f"{'PASS' if good else r['outcome'].upper()}</span> <small>({r['seconds']} s)</small></h3>"
                         f"<p class='q'>{esc(r['question'])}</p><p>{esc(r['doc'])}</p>")
            for k, item in enumerate(r["evidence"]):
                parts.append(_item_html(out, r["name"], k, item))
            if r["failure"]:
                parts.append(f"<pre>{esc(r['failure'])}</pre>")
            parts.append("</div>")
    path = out / "index.html"
    path.write_text("\n".join(parts))
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    return path


def run_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpupool acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("report", help="run the four suites (or read their results) and write the report")
    r.add_argument("--out", required=True)
    r.add_argument("--results", help="the results.json of an earlier run, instead of running the suites")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.results:
        results = Path(args.results)
        status = 0
    else:
        results = out / "results.json"
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        status = run_suites(results)
        print(f"suites ran in {time.monotonic() - t0:.0f} s (exit {status})", file=sys.stderr)
    try:
        doc = json.loads(results.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"no results to report ({results}: {exc})") from None
    path = render(doc, out)
    failed = [r["name"] for r in doc["results"] if r["outcome"] != "passed"]
    print(f"{path}: {len(doc['results']) - len(failed)} passed, {len(failed)} failed" +
          (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed or status else 0
