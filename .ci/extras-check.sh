#!/usr/bin/env bash
# The extras work alone: a fresh venv with only celery-lease[postgres,redis] (no test
# extras) runs `lease migrate`, then a real prefork `celery worker` on Redis + PostgreSQL
# runs one leased task to SUCCESS. Needs CELERY_LEASE_TEST_PG_URL (an admin URL: a scratch
# database is created there and dropped) and CELERY_LEASE_TEST_REDIS_URL (a queue of its
# own). Bounded: pip 150 s, the task 60 s, the worker's stop 20 s.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
: "${CELERY_LEASE_TEST_PG_URL:?needs CELERY_LEASE_TEST_PG_URL}"
: "${CELERY_LEASE_TEST_REDIS_URL:?needs CELERY_LEASE_TEST_REDIS_URL}"
PYTHON=${PYTHON:-python3}
started=$SECONDS
work=$(mktemp -d)
worker_pid=""
database="extras_check_$$_$RANDOM"
venv="$work/venv"

# Run Python in the check's venv, from its own directory: never the checkout's sources.
vpython() { (cd "$work/app" && timeout 60 "$venv/bin/python" "$@"); }

admin() {  # one statement on the admin database, with the venv's driver
    vpython -c '
import sys
from sqlalchemy import create_engine, text
engine = create_engine(sys.argv[1], isolation_level="AUTOCOMMIT")
with engine.connect() as conn:
    conn.execute(text(sys.argv[2]))
engine.dispose()' "$CELERY_LEASE_TEST_PG_URL" "$1"
}

cleanup() {
    set +e
    if [ -n "$worker_pid" ] && kill -0 "$worker_pid" 2>/dev/null; then
        local stop_started=$SECONDS
        kill -TERM "$worker_pid"  # warm shutdown: the worker stops its pool children itself
        for _ in $(seq 200); do kill -0 "$worker_pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$worker_pid" 2>/dev/null; then
            echo "extras-check: worker $worker_pid still up after 20 s: kill -9" >&2
            kill -KILL "$worker_pid"
        fi
        wait "$worker_pid" 2>/dev/null
        echo "extras-check: worker stopped in $((SECONDS - stop_started)) s"
    fi
    if [ -x "$venv/bin/python" ]; then admin "DROP DATABASE IF EXISTS $database" >/dev/null 2>&1; fi
    rm -rf "$work"
}
trap cleanup EXIT

"$PYTHON" -m venv "$venv"
timeout 150 "$venv/bin/python" -m pip install -qq --disable-pip-version-check \
    "$root[postgres,redis]"
echo "extras-check: installed celery-lease[postgres,redis] alone ($((SECONDS - started)) s)"
mkdir "$work/app"
cp "$root/.ci/extras_app.py" "$work/app/"
# What the venv holds: the extras' own dependencies, and no test extras.
vpython -c '
import importlib.metadata as md, importlib.util as iu
import celery_lease
assert "site-packages" in celery_lease.__file__, celery_lease.__file__
for name in ("pytest", "pymysql", "prometheus_client", "django", "opentelemetry"):
    assert iu.find_spec(name) is None, f"{name} is installed: not the extras alone"
print("extras-check:", ", ".join(
    f"{d} {md.version(d)}" for d in ("celery-lease", "celery", "kombu", "redis", "psycopg")))'

admin "CREATE DATABASE $database"
pg_url=$(vpython -c '
import sys
from sqlalchemy.engine import make_url
print(make_url(sys.argv[1]).set(database=sys.argv[2]).render_as_string(hide_password=False))' \
    "$CELERY_LEASE_TEST_PG_URL" "$database")
export EXTRAS_PG_URL="$pg_url" EXTRAS_REDIS_URL="$CELERY_LEASE_TEST_REDIS_URL"
export EXTRAS_QUEUE="extras-check-$$-$RANDOM"

(cd "$work/app" && timeout 60 "$venv/bin/celery" -A extras_app lease migrate)
(cd "$work/app" && exec "$venv/bin/celery" -A extras_app worker -P prefork -c 1 \
    --without-gossip --without-mingle --without-heartbeat --loglevel INFO) \
    >"$work/worker.log" 2>&1 &
worker_pid=$!

if ! vpython -c '
from extras_app import double
result = double.delay(21)
assert result.get(timeout=50) == 42, result.result
print("extras-check: double(21) ->", result.result, result.state)'; then
    echo "extras-check: FAILED; worker log:" >&2
    cat "$work/worker.log" >&2
    exit 1
fi
status=$(cd "$work/app" && timeout 60 "$venv/bin/celery" -A extras_app lease show extras:21 --json \
    | "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["status"])')
if [ "$status" != succeeded ]; then
    echo "extras-check: run extras:21 is $status, not succeeded; worker log:" >&2
    cat "$work/worker.log" >&2
    exit 1
fi
echo "extras-check: run extras:21 succeeded in a worker on Redis + PostgreSQL ($((SECONDS - started)) s)"
