"""freeze_startup_heap, which the server's processes call once started: its garbage freed first, the rest out of
later collections."""

import gc
import weakref

from nanoengine.utils.gc_heap import freeze_startup_heap


class Node:
    pass


def test_the_startup_heap_is_frozen_after_its_garbage_is_collected():
    assert gc.get_freeze_count() == 0  # else unfreezing below would thaw what someone else froze
    gc.disable()  # no automatic collection may free the cycle before freeze_startup_heap does
    try:
        garbage = Node()
        garbage.self = garbage  # a cycle: only a collection frees it
        collected = weakref.ref(garbage)
        del garbage
        alive = Node()
        freeze_startup_heap()
        assert collected() is None  # freed, not frozen forever
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # a collection no longer walks it
    finally:
        gc.unfreeze()
        gc.enable()
    assert any(o is alive for o in gc.get_objects())
