"""Targets: asking a server who it is (``probe``), the embedded twin (``embedded``), servers launched from
a sweep's template (``launch``), and the ``/metrics`` scraper process (``scraper``)."""
