// A tiny Node `http` application for the end-to-end tests: the WSGI app's behaviour.
//
// GET /healthz answers `ok` (`503` when APP_UNREADY is set: a server that never becomes ready);
// every other path answers `Hello from worker <pid>!` (the hello worker's answer), and the `x-server`
// header says `node`. `?cpu=MS` first burns MS milliseconds of CPU (at most 1000; it blocks the event loop, as a CPU-bound handler
// does), so one worker can be loaded more than another; `/slow?ms=N` first sleeps N milliseconds (at
// most 60000) without blocking. It listens on file descriptor 3, the socket passed by socket
// activation (LISTEN_FDS=1): `node tests/apps/node_app.js`. On SIGTERM it stops accepting, closes
// idle keep-alive connections and connections that never carried a request, answers what is in
// flight with `Connection: close`, and exits 0 once every connection is closed.
'use strict';

const http = require('node:http');

const SERVER = 'node';
const MAX_CPU_MS = 1000;
const MAX_SLEEP_MS = 60000;

// CPU time of this thread where Node can tell (of the process otherwise), in microseconds.
const cpuMicros = () => {
  const usage = process.threadCpuUsage ? process.threadCpuUsage() : process.cpuUsage();
  return usage.user + usage.system;
};

// Busy-loops until `ms` milliseconds of CPU have been used.
const burnCpu = (ms) => {
  const end = cpuMicros() + ms * 1000;
  while (cpuMicros() < end) {
    // burn
  }
};

// The query's `name` as a count of milliseconds (0 when absent, capped); NaN if malformed.
const millis = (query, name, cap) => {
  const value = query.get(name);
  if (value === null) {
    return 0;
  }
  if (!/^\d+$/.test(value)) {
    return NaN;
  }
  return Math.min(Number(value), cap);
};

let closing = false;

const server = http.createServer((req, res) => {
  const url = new URL(req.url, 'http://localhost');
  const answer = (status, body) => {
    res.writeHead(status, {
      'Content-Type': 'text/plain',
      'Content-Length': Buffer.byteLength(body),
      'X-Server': SERVER,
      ...(closing ? { Connection: 'close' } : {}),
    });
    res.end(req.method === 'HEAD' ? undefined : body);
  };
  if (url.pathname === '/healthz') {
    // APP_UNREADY in the environment: a server that never becomes ready.
    if (process.env.APP_UNREADY) {
      answer(503, 'not ready\n');
    } else {
      answer(200, 'ok\n');
    }
    return;
  }
  const cpu = millis(url.searchParams, 'cpu', MAX_CPU_MS);
  const sleep = url.pathname === '/slow' ? millis(url.searchParams, 'ms', MAX_SLEEP_MS) : 0;
  if (Number.isNaN(cpu) || Number.isNaN(sleep)) {
    answer(400, 'cpu and ms take a count of milliseconds\n');
    return;
  }
  burnCpu(cpu);
  setTimeout(() => answer(200, `Hello from worker ${process.pid}!\n`), sleep);
});

// Connections that have not begun a request. A proxy opens some ahead of need (Envoy does when a
// request it opened one for is sent on another that freed first), and Node counts a new connection
// as busy until its first request: server.close() waits for them and closeIdleConnections() leaves
// them, so without this a drained server would wait for its SIGKILL.
const unused = new Set();
server.on('connection', (socket) => {
  unused.add(socket);
  socket.once('close', () => unused.delete(socket));
});
server.on('request', (req) => unused.delete(req.socket));

const closeUnused = () => {
  for (const socket of unused) {
    socket.destroy();
  }
  server.closeIdleConnections();
};

process.on('SIGTERM', () => {
  closing = true;
  server.close(() => process.exit(0));
  // A connection busy at the signal is answered with `Connection: close`; one that turns idle
  // without another request (a response that was already on its way) is closed on the next pass.
  closeUnused();
  setInterval(closeUnused, 100).unref();
});

server.listen({ fd: 3 });
