// GPUMesh dashboard: sign-in, actions through the control API, live job logs,
// GPU charts and the theme switch. No inline script anywhere (see the CSP).
"use strict";
(function () {
  const CSRF = { "x-gpumesh-csrf": "1" };
  const $ = (selector, root) => (root || document).querySelector(selector);

  // --- notices ---------------------------------------------------------------
  function notice(text, bad) {
    const el = $("#notice");
    el.textContent = text;
    el.classList.toggle("bad", !!bad);
  }

  async function api(method, path, body, headers) {
    const init = { method, headers: Object.assign({}, CSRF, headers || {}), credentials: "same-origin" };
    if (body !== undefined) {
      init.headers["content-type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
    if (!response.ok) {
      const message = data && data.message ? data.message : `${response.status} ${response.statusText}`;
      throw new Error(message);
    }
    return data;
  }

  // --- theme -----------------------------------------------------------------
  function setupTheme() {
    const root = document.documentElement;
    const asked = new URLSearchParams(location.search).get("theme");
    let theme = root.dataset.theme || "";
    if (!asked) {
      try { theme = localStorage.getItem("gpumesh-theme") || ""; } catch (e) { theme = ""; }
      root.dataset.theme = theme;
    }
    const select = $("#theme-switch");
    if (!select) return;
    select.value = theme;
    select.addEventListener("change", () => {
      root.dataset.theme = select.value;
      try { localStorage.setItem("gpumesh-theme", select.value); } catch (e) { /* private mode */ }
      document.dispatchEvent(new CustomEvent("gpumesh:theme"));
    });
  }

  // --- sign-in ---------------------------------------------------------------
  async function exchange(code) {
    await api("POST", "/api/v1/auth/session", { code });
  }

  async function signInFromFragment() {
    const code = new URLSearchParams(location.hash.slice(1)).get("code");
    if (!code) return false;
    history.replaceState(null, "", location.pathname + location.search);
    try {
      await exchange(code);
      location.reload();
    } catch (e) {
      notice(`Sign-in failed: ${e.message}`, true);
    }
    return true;
  }

  function setupLogin() {
    const form = $("#login");
    if (!form) return;
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const given = form.elements.token.value.trim();
      try {
        const inUrl = given.match(/#code=([A-Za-z0-9_-]+)/);
        const elsewhere = inUrl && /^http:\/\/[0-9a-f]+\.localhost(:\d+)?\//.test(given)
          && !given.startsWith(location.origin + "/");
        if (elsewhere) {
          location.assign(given);  // a login URL at the home's own name: sign in there
          return;
        } else if (inUrl) {
          await exchange(inUrl[1]);
        } else {
          // The new URL is at the home's own host name, where the session cookie
          // counts; it signs in on arrival (signInFromFragment).
          const login = await api("POST", "/api/v1/auth/login-codes", undefined,
            { authorization: `Bearer ${given}` });
          location.assign(login.url);
          return;
        }
        location.reload();
      } catch (e) {
        notice(`Sign-in failed: ${e.message}`, true);
      }
    });
  }

  // --- actions ---------------------------------------------------------------
  function refreshLive() {
    const live = $("#live");
    if (live && window.htmx) {
      window.htmx.ajax("GET", location.pathname, { target: "#live", select: "#live", swap: "outerHTML" });
    }
  }

  function after(then, result, source) {
    if (then === "reload") location.reload();
    else if (then === "job" && result && result.job_id) location.assign(`/jobs/${encodeURIComponent(result.job_id)}`);
    else if (then === "connect") {
      const out = document.getElementById(source.dataset.result);
      const text = result.reachable
        ? `${result.path}, ${result.rtt_ms.toFixed(1)} ms RTT`
        : `unreachable`;
      if (out) out.textContent = text;
      notice(`${result.peer}: ${text}`);
    } else if (then === "refresh") refreshLive();
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-api]");
    if (!button) return;
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    const [method, path] = button.dataset.api.split(" ");
    const body = button.dataset.body ? JSON.parse(button.dataset.body) : undefined;
    button.disabled = true;
    notice(`${button.textContent}…`);
    try {
      const result = await api(method, path, body);
      notice(`${button.textContent}: done`);
      after(button.dataset.then, result, button);
    } catch (e) {
      notice(`${button.textContent}: ${e.message}`, true);
    } finally {
      button.disabled = false;
    }
  });

  // A command line as argv: words split on blanks, '…' and "…" keep blanks.
  function splitCommand(text) {
    const words = [];
    let word = null;
    let quote = null;
    for (const ch of text) {
      if (quote) {
        if (ch === quote) quote = null; else word += ch;
      } else if (ch === "'" || ch === '"') {
        quote = ch; word = word || "";
      } else if (/\s/.test(ch)) {
        if (word !== null) { words.push(word); word = null; }
      } else {
        word = (word || "") + ch;
      }
    }
    if (quote) throw new Error("the command has an unclosed quote");
    if (word !== null) words.push(word);
    return words;
  }

  function formBody(form) {
    if (form.id === "pair") return { code: form.elements.code.value.trim() };
    if (form.id === "run") {
      const [kind, name] = form.elements.where.value.split(/:(.*)/s);
      const env = {};
      for (const line of form.elements.env.value.split("\n")) {
        if (!line.trim()) continue;
        const at = line.indexOf("=");
        if (at < 1) throw new Error(`environment line ${JSON.stringify(line)}: use NAME=value`);
        env[line.slice(0, at).trim()] = line.slice(at + 1);
      }
      const body = { command: splitCommand(form.elements.command.value), env };
      body[kind] = name;
      if (form.elements.image.value.trim()) body.image = form.elements.image.value.trim();
      if (form.elements.gpu_memory.value.trim()) body.gpu_memory = form.elements.gpu_memory.value.trim();
      const retries = parseInt(form.elements.retries.value || "0", 10);
      if (retries) body.retries = retries;
      return body;
    }
    return {};
  }

  document.addEventListener("submit", async (event) => {
    const form = event.target.closest("form[data-api]");
    if (!form) return;
    event.preventDefault();
    const [method, path] = form.dataset.api.split(" ");
    const button = form.querySelector("button[type=submit]");
    try {
      const body = formBody(form);
      if (button) button.disabled = true;
      notice(`${button ? button.textContent : "Sending"}…`);
      const result = await api(method, path, body);
      notice("done");
      after(form.dataset.then, result, form);
    } catch (e) {
      notice(e.message, true);
    } finally {
      if (button) button.disabled = false;
    }
  });

  // --- a job's live log --------------------------------------------------------
  function setupJob() {
    const section = $("#job");
    const log = $("#log");
    if (!section || !log) return;
    const jobId = section.dataset.job;
    const filter = $("#log-filter");
    let lastSeq = 0;
    const open = { stdout: null, stderr: null };  // a line not yet ended, per stream

    function shown(line) {
      const want = filter.value;
      line.classList.toggle("hidden", !!want && !line.textContent.includes(want));
    }
    function append(stream, text) {
      const parts = text.split("\n");
      parts.forEach((part, i) => {
        const last = i === parts.length - 1;
        if (last && part === "") return;  // the text ended its line
        let line = open[stream];
        if (!line) {
          line = document.createElement("div");
          line.className = `line ${stream}`;
          line.dataset.stream = stream;
          log.appendChild(line);
        }
        line.textContent += part;
        shown(line);
        open[stream] = last ? line : null;
      });
      log.scrollTop = log.scrollHeight;
    }
    filter.addEventListener("input", () => log.querySelectorAll(".line").forEach(shown));

    const source = new EventSource(`/api/v1/jobs/${encodeURIComponent(jobId)}/events`);
    const numbered = (event) => {
      // The stream resumes after Last-Event-ID on a reconnect; never show an event twice.
      const seq = event.lastEventId ? parseInt(event.lastEventId, 10) : 0;
      if (seq && seq <= lastSeq) return false;
      if (seq) lastSeq = seq;
      return true;
    };
    source.addEventListener("output", (event) => {
      if (!numbered(event)) return;
      const data = JSON.parse(event.data);
      append(data.stream === "stderr" ? "stderr" : "stdout", data.text);
    });
    source.addEventListener("status", (event) => {
      if (!numbered(event)) return;
      const data = JSON.parse(event.data);
      const state = $("#job-state");
      state.textContent = data.state;
      state.className = `state state-${data.state}`;
      if (data.exit_code !== null) $("#job-exit").textContent = data.exit_code;
    });
    source.addEventListener("dropped", (event) => {
      const data = JSON.parse(event.data);
      append("stderr", `[${data.count} bytes of output dropped by the provider]\n`);
    });
    source.addEventListener("end", (event) => {
      source.close();
      const data = JSON.parse(event.data);
      const state = $("#job-state");
      state.textContent = data.state;
      state.className = `state state-${data.state}`;
      $("#job-exit").textContent = data.exit_code === null ? "-" : data.exit_code;
      const why = data.message && data.message !== data.state ? ` (${data.message})` : "";
      $("#log-end").textContent = `The job ended: ${data.state}${why}.`;
      section.dataset.ended = "1";
      const cancel = $("#cancel");
      if (cancel) cancel.hidden = true;
    });
    source.addEventListener("error", (event) => {
      if (event.data) {
        source.close();
        $("#log-end").textContent = JSON.parse(event.data).message;
      }
      // Without data it is the connection: EventSource reconnects with Last-Event-ID.
    });
  }

  // --- GPU charts --------------------------------------------------------------
  const charts = [];
  window.gpumeshCharts = charts;

  // uPlot's columns: time, then each series (memory as a percentage of the GPU's).
  function chartData(gpu) {
    const share = (m) => (gpu.memory_total ? Math.round((1000 * m) / gpu.memory_total) / 10 : null);
    return [gpu.times, gpu.utilization, gpu.memory_used.map(share), gpu.temperature, gpu.power];
  }

  function makeChart(el, gpu) {
    const style = getComputedStyle(document.documentElement);
    const color = (name) => style.getPropertyValue(name).trim();
    const width = Math.max(260, el.clientWidth || 320);
    return new window.uPlot({
      width,
      height: 200,
      series: [
        {},
        { label: "Utilisation %", stroke: color("--accent"), scale: "%" },
        { label: "Memory %", stroke: color("--ok"), scale: "%" },
        { label: "Temperature °C", stroke: color("--danger"), scale: "%" },
        { label: "Power W", stroke: color("--muted"), scale: "W" },
      ],
      scales: { "%": { range: [0, 100] } },
      axes: [
        { stroke: color("--fg"), grid: { stroke: color("--line") } },
        { scale: "%", stroke: color("--fg"), grid: { stroke: color("--line") } },
        { scale: "W", side: 1, stroke: color("--fg"), grid: { show: false } },
      ],
    }, chartData(gpu), el);
  }

  async function updateCharts() {
    let history;
    try {
      history = await api("GET", "/api/v1/gpus/history");
    } catch (e) {
      return;
    }
    for (const gpu of history.gpus) {
      const el = document.querySelector(`[data-chart="${gpu.index}"]`);
      if (!el) continue;
      let entry = charts.find((c) => c.index === gpu.index);
      if (!entry) {
        entry = { index: gpu.index, el, plot: makeChart(el, gpu), data: null };
        charts.push(entry);
      }
      entry.data = chartData(gpu);
      entry.plot.setData(entry.data);
      el.dataset.samples = String(gpu.times.length);
      el.dataset.last = gpu.times.length ? String(gpu.times[gpu.times.length - 1]) : "";
    }
  }

  function setupCharts() {
    if (!$("[data-chart]") || !window.uPlot) return;
    updateCharts();
    setInterval(updateCharts, 5000);
    document.addEventListener("gpumesh:theme", () => {
      for (const entry of charts.splice(0)) {
        entry.plot.destroy();
      }
      updateCharts();
    });
  }

  document.addEventListener("DOMContentLoaded", async () => {
    setupTheme();
    if (await signInFromFragment()) return;
    setupLogin();
    setupJob();
    setupCharts();
  });
})();
