"""Verification of the kernels on this CPU class: the half-type grid (``halfgrid``), the record per CPU class
(``record``: ``attnlab verify``, ``make verify``)."""
