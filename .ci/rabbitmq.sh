# RabbitMQ for CI, sourced by .ci/run: `rabbitmq_start DIR` starts a throwaway node
# (the Debian package's rabbitmq-server) as the rabbitmq user, with every file under DIR
# and its AMQP, distribution and epmd ports on free loopback ports, waits until it answers
# the AMQP handshake, and sets RABBITMQ_AMQP_URL. `rabbitmq_stop` stops it (and the epmd
# it started) by PID and checks that neither is left. No plugins; guest may log in
# over loopback only (the listener binds 127.0.0.1).

rabbitmq_server_pid=""
rabbitmq_epmd_pid=""
rabbitmq_dir=""

_rabbitmq_free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# 0 when something on 127.0.0.1:$1 answers the AMQP 0-9-1 protocol header with a
# method frame (Connection.Start), i.e. the broker takes connections.
_rabbitmq_answers_amqp() {
    python3 - "$1" <<'PY'
import socket, sys
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as s:
        s.settimeout(2)
        s.sendall(b"AMQP\x00\x00\x09\x01")
        sys.exit(0 if s.recv(1) == b"\x01" else 1)
except OSError:
    sys.exit(1)
PY
}

rabbitmq_start() {
    rabbitmq_dir=$1
    local node_port dist_port epmd_port
    node_port=$(_rabbitmq_free_port)
    dist_port=$(_rabbitmq_free_port)
    epmd_port=$(_rabbitmq_free_port)
    mkdir -p "$rabbitmq_dir/mnesia" "$rabbitmq_dir/log"
    echo '[].' >"$rabbitmq_dir/enabled_plugins"
    # The listener is on 127.0.0.1 only, so guest may log in from the tests.
    echo 'loopback_users = none' >"$rabbitmq_dir/rabbitmq.conf"
    cat >"$rabbitmq_dir/env" <<ENV
HOME=$rabbitmq_dir
RABBITMQ_NODENAME=rabbitci@localhost
RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
RABBITMQ_NODE_PORT=$node_port
RABBITMQ_DIST_PORT=$dist_port
ERL_EPMD_PORT=$epmd_port
ERL_EPMD_ADDRESS=127.0.0.1
RABBITMQ_MNESIA_BASE=$rabbitmq_dir/mnesia
RABBITMQ_LOG_BASE=$rabbitmq_dir/log
RABBITMQ_ENABLED_PLUGINS_FILE=$rabbitmq_dir/enabled_plugins
RABBITMQ_CONFIG_FILE=$rabbitmq_dir/rabbitmq.conf
RABBITMQ_PID_FILE=$rabbitmq_dir/pid
ENV
    chown -R rabbitmq "$rabbitmq_dir"
    # setpriv execs (no forking su), so $! is the PID of the process itself. Our own
    # epmd first, on its own port: the node registers with it instead of starting a
    # daemonized one we could not stop by PID.
    local as_rabbitmq=(setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups env -i
        PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)
    # shellcheck disable=SC2046
    "${as_rabbitmq[@]}" $(cat "$rabbitmq_dir/env") epmd -port "$epmd_port" -address 127.0.0.1 \
        >"$rabbitmq_dir/epmd.log" 2>&1 &
    rabbitmq_epmd_pid=$!
    # The server script runs the Erlang VM as its child and stops it on SIGTERM.
    # shellcheck disable=SC2046
    "${as_rabbitmq[@]}" $(cat "$rabbitmq_dir/env") /usr/lib/rabbitmq/bin/rabbitmq-server \
        >"$rabbitmq_dir/server.log" 2>&1 &
    rabbitmq_server_pid=$!
    local _
    for _ in $(seq 120); do
        if ! kill -0 "$rabbitmq_server_pid" 2>/dev/null; then
            echo "rabbitmq-server exited during start:" >&2
            tail -n 40 "$rabbitmq_dir/server.log" >&2
            return 1
        fi
        if _rabbitmq_answers_amqp "$node_port"; then
            RABBITMQ_AMQP_URL="amqp://guest:guest@127.0.0.1:$node_port//"
            return 0
        fi
        sleep 0.5
    done
    echo "rabbitmq-server did not accept AMQP connections within 60 s:" >&2
    tail -n 40 "$rabbitmq_dir/server.log" >&2
    return 1
}

# 0 while PID $1 runs (a zombie no longer counts).
_rabbitmq_alive() {
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat"
}

rabbitmq_stop() {
    local - beam_pid="" left="" _
    set +e  # a cleanup step: every check below runs, whatever failed before it
    if [ -s "$rabbitmq_dir/pid" ]; then beam_pid=$(cat "$rabbitmq_dir/pid"); fi
    if [ -n "$rabbitmq_server_pid" ]; then
        kill -TERM "$rabbitmq_server_pid" 2>/dev/null
        for _ in $(seq 150); do _rabbitmq_alive "$rabbitmq_server_pid" || break; sleep 0.2; done
        kill -KILL "$rabbitmq_server_pid" 2>/dev/null
        wait "$rabbitmq_server_pid" 2>/dev/null
    fi
    if _rabbitmq_alive "$beam_pid"; then
        kill -KILL "$beam_pid" 2>/dev/null
        for _ in $(seq 50); do _rabbitmq_alive "$beam_pid" || break; sleep 0.1; done
    fi
    if [ -n "$rabbitmq_epmd_pid" ]; then
        kill -TERM "$rabbitmq_epmd_pid" 2>/dev/null
        wait "$rabbitmq_epmd_pid" 2>/dev/null
    fi
    for pid in $rabbitmq_server_pid $beam_pid $rabbitmq_epmd_pid; do
        if _rabbitmq_alive "$pid"; then left="$left $pid"; fi
    done
    rabbitmq_server_pid="" rabbitmq_epmd_pid=""
    if [ -n "$left" ]; then
        echo "rabbitmq: processes left running:$left" >&2
        return 1
    fi
}
