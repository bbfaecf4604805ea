"""HTML report: content, escaping of untrusted model strings, plots, degenerate results.

The result is produced by the real harness.run.verify_model with scripted fake backends, so
the test follows the real schema. Expected facts (which backend passes, where one diverges,
which crashes) are designed into the fakes, not read from the code under test.
"""
import base64
import hashlib
import io
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.config import ModelRef, ProtocolConfig, RunConfig
from harness.errors import BackendCrash
from harness.results import SCHEMA, read_json, write_json
from harness.run import verify_model
from harness.summary import Gate
from reports import fmt, plots, render_html, render_report, render_report_from_json

V, PROMPT, N, CTX, DIV = 40, (3, 7, 11, 2), 12, 32, 5
EVIL = "<script>alert(1)</script>"
EVIL_META = "<img src=x onerror=alert(2)>{{ 7*7 }}"


class Fake:
    """Logits depend on (position, last token). 'oracle' exposes float64 logits; 'exact'
    returns them as float32; 'flip' adds noise and promotes the runner-up at generated
    position DIV; 'crash' fails to load."""

    def __init__(self, name):
        self.name, self.fed = name, []

    def load(self, model, cfg):
        if self.name == "crash":
            raise BackendCrash("child died: SIGSEGV in the matmul")

    def reset(self):
        self.fed = []

    def _out(self):
        rng = np.random.default_rng([len(self.fed), self.fed[-1]])
        x = rng.normal(size=V) * 3.0
        if self.name == "oracle":
            self.last_logits64 = x
        if self.name == "flip":
            x = x + rng.normal(size=V) * 1e-3
            if len(self.fed) - len(PROMPT) == DIV:
                x[np.argsort(x)[-2]] = x.max() + 1.0
        return x.astype(np.float32)

    def prefill(self, tokens):
        self.fed += list(tokens)
        return self._out()

    def step(self, token):
        self.fed.append(token)
        return self._out()

    def capabilities(self):
        return set()

    def close(self):
        pass


def _result(backends):
    model = ModelRef(EVIL + '"q', Path("/models/m.gguf"), "ab" * 32, 1234567)
    proto = ProtocolConfig(PROMPT, n_predict=N, contexts=(CTX,),
                           extra={"text": "the prompt\u202e text", "pieces": {}})
    return verify_model(model, {"arch": "qwen2", "chat_template": EVIL_META}, proto,
                        RunConfig(n_ctx=CTX), backends, Fake, gate_cfg=Gate(margin_rel=1e-12))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(result as read back from JSON, its report path, the html text)."""
    res = _result(["oracle", "exact", "flip", "crash"])
    flip = next(r for r in res["runs"] if r["backend"] == "flip" and r["mode"] == "greedy")
    pieces = {i: f" w{i}" for i in range(V)}
    pieces[flip["ids"][DIV]] = EVIL  # the token the flipped backend picks
    res["prompt"]["pieces"] = pieces
    path = tmp_path_factory.mktemp("run") / "result.json"
    write_json(path, res)
    out = render_report_from_json(path)
    return read_json(path), out, out.read_text(encoding="utf-8")


class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children, self.text = tag, dict(attrs), [], ""

    def find(self, tag, cls=None):
        for c in self.children:
            if c.tag == tag and (cls is None or cls in c.attrs.get("class", "").split()):
                yield c
            yield from c.find(tag, cls)

    def all_text(self):
        return self.text + "".join(c.all_text() for c in self.children)


class Tree(HTMLParser):
    """Minimal DOM; raises on a mismatched end tag, so it doubles as a well-formedness check."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self, html):
        super().__init__()
        self.root = Node("#root", [])
        self.stack = [self.root]
        self.feed(html)
        self.close()
        assert self.stack == [self.root], f"unclosed: {[n.tag for n in self.stack[1:]]}"

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs)
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].text += data


def _section_table(tree, heading_id):
    """The first <table> after the <h2 id=heading_id>."""
    body = next(tree.root.find("body"))
    kids = body.children
    start = next(i for i, n in enumerate(kids) if n.attrs.get("id") == heading_id)
    return next(n for n in kids[start:] if n.tag == "table")


def test_report_beside_json_and_well_formed(full):
    res, out, html = full
    assert out.name == "report.html" and out.parent.joinpath("result.json").exists()
    tree = Tree(html)
    assert html.startswith("<!DOCTYPE html>")
    ids = {n.attrs.get("id") for n in tree.root.find("h2")}
    assert {"verdicts", "summary", "errors", "plots", "divergences", "tokens", "prompt",
            "model", "machine", "settings"} <= ids


def test_verdict_table_matches_designed_backends(full):
    rows = _section_table(Tree(full[2]), "verdicts").find("tr")
    got = {}
    for tr in list(rows)[1:]:
        cells = [td.all_text().strip() for td in tr.find("td")]
        got[(cells[0], cells[1])] = (cells[2], tr.attrs["class"])
    assert got == {("exact", str(CTX)): ("PASS", "pass"), ("flip", str(CTX)): ("FAIL", "fail"),
                   ("crash", str(CTX)): ("ERROR", "error")}


def test_divergence_marked_at_designed_position(full):
    res, _, html = full
    table = _section_table(Tree(html), "tokens")
    header = [th.all_text() for th in next(table.find("tr")).find("th")]
    rows = [tr for tr in table.find("tr") if "data-pos" in tr.attrs]
    assert len(rows) == N
    marked = [(int(tr.attrs["data-pos"]), td) for tr in rows for td in tr.find("td", "first-div")]
    assert len(marked) == 1  # only the flipped backend diverges, once
    pos, td = marked[0]
    assert pos == DIV
    row = rows[DIV]
    col = list(row.find("td")).index(td)
    assert header[col] == f"flip c={CTX} greedy"
    assert row.attrs.get("class") == "has-div"
    # before the divergence the flipped run's cells are unmarked
    assert all("div" not in list(rows[i].find("td"))[col].attrs["class"] for i in range(DIV))
    assert td.find("a").__next__().attrs["href"] == "#" + _greedy_flip_anchor(res)


def _greedy_flip_anchor(res):
    k = next(k for k, r in enumerate(res["runs"]) if r["backend"] == "flip" and r["mode"] == "greedy")
    return f"div-{k}"


def test_divergence_details_show_both_top5(full):
    res, _, html = full
    body = next(Tree(html).root.find("body")).children
    h = next(i for i, n in enumerate(body) if n.attrs.get("id") == _greedy_flip_anchor(res))
    assert f"position {DIV}" in body[h].all_text()
    box = next(n for n in body[h:] if n.tag == "div")
    ref_t, own_t = list(box.find("table"))
    flip = next(r for r in res["runs"] if r["backend"] == "flip" and r["mode"] == "greedy")
    ref_id, own_id = res["reference"]["ids"][DIV], flip["ids"][DIV]
    for table, top_id, cls in ((ref_t, ref_id, "ref-choice"), (own_t, own_id, "own-choice")):
        rows = [tr for tr in table.find("tr") if list(tr.find("td"))]
        assert len(rows) == 5
        # rank 1 of each list is the id that side generated
        assert rows[0].attrs["class"] == cls
        assert list(rows[0].find("span", "tid"))[0].all_text() == str(top_id)


def test_untrusted_strings_are_escaped(full):
    html = full[2]
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(2)&gt;" in html
    assert "{{ 7*7 }}" in html  # data is never evaluated as a template
    assert "\u202e" not in html  # bidi override shown as an escape, not applied
    assert "&#34;q" in html or "&quot;q" in html


def test_plots_are_embedded_png(full):
    html = full[2]
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == 3  # KL, max-abs, NMSE of the teacher-forced runs
    import matplotlib.image as mpimg
    img = mpimg.imread(io.BytesIO(base64.b64decode(uris[0])), format="png")
    assert img.shape[:2] == (300, 800)


def test_self_contained(full):
    html = full[2]
    assert "<link" not in html
    for ref in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert ref.startswith(("data:image/png;base64,", "#")), ref


def test_summary_hashes_errors_and_machine(full):
    res, _, html = full
    flip = next(r for r in res["runs"] if r["backend"] == "flip" and r["mode"] == "greedy")
    sha = hashlib.sha256(np.asarray(flip["ids"], "<i8").tobytes()).hexdigest()
    assert f'title="{sha}">{sha[:12]} ≠' in html
    ref_sha = hashlib.sha256(np.asarray(res["reference"]["ids"], "<i8").tobytes()).hexdigest()
    assert html.count(f'title="{ref_sha}">{ref_sha[:12]} =') == 2  # exact: greedy + forced
    assert "BackendCrash: child died: SIGSEGV in the matmul" in html
    assert res["machine"]["cpu"] in html and "qwen2" in html
    assert f"{DIV} / {N}" in html  # match prefix of the flipped run


def test_summary_tok_s_are_labelled_as_loop_rates(full):
    """The summary's tok/s are the comparison loop's (host round trips and metrics included),
    as the console's "loop tok/s" column says; not throughput (that is --bench's table)."""
    head = [th.all_text() for th in next(_section_table(Tree(full[2]), "summary").find("tr"))
            .find("th")]
    assert head[-3:] == ["loop prefill tok/s", "loop decode tok/s", "loop ms/token"]
    assert "not a throughput figure" in full[2]


def test_reference_only_result_renders(tmp_path):
    res = _result(["oracle"])
    assert res["runs"] == [] and res["verdicts"] == []
    out = render_report(res, tmp_path / "r.html")
    html = out.read_text(encoding="utf-8")
    Tree(html)
    assert "No compared backends" in html and "data:image/png" not in html
    assert html.count("<tr data-pos=") == N


def test_empty_and_extra_sections_render(tmp_path):
    html = render_html({"schema": SCHEMA})
    Tree(html)
    bench = [{"backend": "llama.cpp", "decode_tok_s": 24.11, "note": EVIL}]
    html = render_html({"schema": SCHEMA, "bench": bench, "kernels": {"rows": [], "gpu": "x"}})
    Tree(html)
    assert "24.11" in html and "&lt;script&gt;" in html and "<script" not in html


MARKUP = st.sampled_from(list("<>&\"'/= ") + ["<script>", "</td>", "<!--", "{{", "{%"])


@settings(max_examples=40, deadline=None)
@given(st.lists(MARKUP | st.characters(), max_size=20).map("".join))
def test_any_model_name_adds_no_markup(name):
    base = render_html({"schema": SCHEMA, "model": {"name": "x"}})
    html = render_html({"schema": SCHEMA, "model": {"name": name}})
    assert html.count("<") == base.count("<")  # every "<" of the name arrives escaped


@given(st.text(max_size=50))
def test_visible_text_has_no_control_characters(s):
    import unicodedata
    v = fmt.visible(s, limit=1000)
    assert not any(unicodedata.category(c) in ("Cc", "Cf") for c in v)
    assert " " not in v  # spaces made visible as a mark


def test_non_finite_json_values_are_read():
    assert fmt.to_float("inf") == float("inf") and fmt.to_float("-inf") == float("-inf")
    assert np.isnan(fmt.to_float("nan")) and fmt.to_float(None) is None
    assert fmt.to_float("junk") is None and fmt.sci("inf") == "inf" and fmt.sci(None) == "–"
    pos, vals = plots.step_values([{"i": 0, "kl": 1e-3}, {"i": 1, "kl": "inf"}, {"i": 2},
                                   {"i": 3, "kl": "nan"}, {"i": 4, "kl": 0.0}], "kl")
    assert pos.tolist() == [0, 1, 2, 3, 4]
    assert vals[0] == 1e-3 and np.isposinf(vals[1]) and np.isnan(vals[2:4]).all()
    assert vals[4] == 0.0


def test_step_plot_handles_odd_values_and_nothing():
    steps = [{"i": i, "kl": v} for i, v in enumerate([1e-3, "inf", None, "nan", 0.0, 2e-5])]
    png = plots.step_plot([("a", steps)], "kl", "t", "KL")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    only_bad = [{"i": 0, "kl": "inf"}, {"i": 1, "kl": 0.0}]
    assert plots.step_plot([("b", only_bad)], "kl", "t", "KL")[:4] == b"\x89PNG"
    assert plots.step_plot([("c", [{"i": 0}, {"i": 1, "kl": None}])], "kl", "t", "KL") is None
    assert plots.step_plot([], "kl", "t", "KL") is None


def test_step_plot_draws_dollar_as_text():
    """Labels come from result files ('$' would start matplotlib mathtext; a bad formula
    made `harness report RESULT.json` fail)."""
    steps = [{"i": 0, "kl": 1e-3}, {"i": 1, "kl": 2e-3}]
    png = plots.step_plot([(r"ll$\frac$ c=512", steps)], "kl", r"t$\frac$", "KL")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_from_json_refuses_other_schemas_and_names_reports_by_file(tmp_path, full):
    """harness report renders run results only (a kernels or nodes result is refused by name,
    nothing written), result.json -> report.html, any other name -> <stem>.report.html, so two
    results in one folder keep two reports."""
    res, out, _ = full
    assert out.name == "report.html"
    for schema in ("gguf-harness/kernels/1", "gguf-harness/nodes/1", "gguf-harness/ab/1"):
        p = tmp_path / f"{schema.split('/')[1]}.json"
        write_json(p, {"schema": schema, "rows": []})
        with pytest.raises(ValueError, match=schema):
            render_report_from_json(p)
        assert not list(tmp_path.glob("*.html"))
    a, b = tmp_path / "a-run.json", tmp_path / "b-run.json"
    write_json(a, res)
    write_json(b, res)
    ra, rb = render_report_from_json(a), render_report_from_json(b)
    assert (ra.name, rb.name) == ("a-run.report.html", "b-run.report.html")
    assert ra.read_bytes() == rb.read_bytes() == out.read_bytes()


def test_machine_section_shows_the_source_digest(full):
    """The report's machine table names the code that ran (machine.source_digest) beside git."""
    res, _, html = full
    digest = res["machine"]["git"].get("source_sha256")
    assert digest and len(digest) == 64
    assert digest in html and "source SHA256" in html
