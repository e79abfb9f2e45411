"""Several front-end processes feeding one engine process (``LMHEAD_WORKERS`` > 1).

* ``arena``: shared memory (an anonymous memfd mapped by both sides) that tensors cross in;
* ``channel``: frames on a Unix socket, a small pickled header with the tensors out of band;
* ``engine_server``: the engine process, owning the registry, batchers and sessions, serving
  fronts;
* ``remote_plane``: ``RemotePlane``, a front's data plane, forwarding every call to the engine;
* ``supervisor``: starts, watches, restarts and stops the processes; ``processes``: their
  entries' helpers.
"""
