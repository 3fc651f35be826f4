"""A stop raised inside one task (SIGTERM's SystemExit) leaves the loop while the others are being
cancelled; the local backend's run still drives every task to its end, so none is closed later at
garbage collection, without a loop, halfway through its cleanup."""

from __future__ import annotations

import asyncio

import pytest

from slime_meta.backends.local.run import _finish_tasks


def test_a_stop_raised_while_tasks_are_cancelled_leaves_no_task_suspended():
    loop = asyncio.new_event_loop()

    async def stopped_inside():  # the stop was raised in this task: it leaves after its own cleanup
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0)
            raise SystemExit(143)

    async def the_run():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    try:
        tasks = [loop.create_task(stopped_inside()), loop.create_task(the_run())]
        loop.run_until_complete(asyncio.sleep(0))
        # asyncio.run's own cancellation stops at the SystemExit, with the run's task still suspended.
        with pytest.raises(SystemExit):
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        assert not tasks[1].done()
        _finish_tasks(loop)
        assert all(task.done() for task in tasks)
    finally:
        loop.close()
