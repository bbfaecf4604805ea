"""HTML reports and plots from result JSON (schema gguf-harness/run/1)."""
from .html import render_html, render_report, render_report_from_json

__all__ = ["render_html", "render_report", "render_report_from_json"]
