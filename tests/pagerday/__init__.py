"""A pager day on one host, played on real demo servers (issue 31 item 5): :mod:`tests.pagerday.day`."""
