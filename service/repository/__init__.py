"""Model versions on disk and in memory: read, load, swap, retire.

The repository's layout and files (``disk``, ``labels``), private copies of versions
(``staging``), one version opened from them (``open_version``) and served with its batcher
and session (``loaded_version``), loading under a version policy (``loading``), the published
records (``records``, ``registry``), polling the disk (``poller``) and the control calls a
restarted engine replays (``journal``).

May import: ``service.runtime``, ``service.heads`` and the shared basics at the package root
(``make layers`` checks the order).
"""
