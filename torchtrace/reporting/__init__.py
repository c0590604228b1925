"""Looking at a run: the live page served beside /metrics, and reports of a finished run.

>>> from torchtrace.reporting import terminal_report, html_report  # doctest: +SKIP
"""

from torchtrace.reporting.cli import add_report_subcommand
from torchtrace.reporting.htmlreport import html_report, write_html_report
from torchtrace.reporting.page import live_page
from torchtrace.reporting.terminal import terminal_report

__all__ = ["add_report_subcommand", "html_report", "live_page", "terminal_report", "write_html_report"]
