"""Every marft env through PettingZoo's AEC and parallel APIs (:mod:`.env`); pettingzoo is an optional dependency
(``pip install marft[games]``)."""
