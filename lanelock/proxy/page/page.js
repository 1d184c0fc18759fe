// The proxy's page: polls /lanelock/status once a second and redraws in place. Every value is set
// as text, never as HTML (a session may call itself anything); no request leaves the proxy.
"use strict";

const POLL = 1000;          // ms between polls
const STALE = 5000;         // ms without an answer before the page says so

let lastAnswer = 0;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function seconds(value) {
  if (typeof value !== "number" || !isFinite(value)) return "—";
  if (value < 60) return value.toFixed(value < 10 ? 1 : 0) + " s";
  if (value < 3600) return Math.floor(value / 60) + " min " + Math.round(value % 60) + " s";
  return Math.floor(value / 3600) + " h " + Math.round((value % 3600) / 60) + " min";
}

function row(cells, numeric) {
  const tr = el("tr");
  cells.forEach((cell, index) => {
    tr.appendChild(el("td", cell, numeric && numeric.includes(index) ? "num" : null));
  });
  return tr;
}

function fill(tbody, rows, none, width) {
  tbody.replaceChildren(...rows);
  if (!rows.length) {
    const tr = el("tr", null, "none");
    const td = el("td", none);
    td.colSpan = width;
    tr.appendChild(td);
    tbody.appendChild(tr);
  }
}

function seatsOf(lane) {
  const count = lane.seats || 1;
  const bySeat = lane.by_seat && lane.by_seat.length ? lane.by_seat
    : [{seat: 1, state: lane.state, holder: lane.holder}];
  const seats = [];
  for (let number = 1; number <= Math.max(count, bySeat.length); number++) {
    const found = bySeat.find((seat) => seat.seat === number);
    seats.push(found || {seat: number, state: "free", holder: null});
  }
  return seats;
}

function seatRows(lane) {
  return seatsOf(lane).map((seat) => {
    const holder = seat.state === "held" ? (seat.holder || {}) : null;
    if (!holder) return row([seat.seat, "free", "", "", ""]);
    const who = holder.pid ? "pid " + holder.pid : "?";
    return row([seat.seat, who, holder.session || "—", holder.model || "—",
      seconds(holder.held_for)], [4]);
  });
}

function queueRows(lane) {
  return (lane.queue || []).map((waiter) => {
    const counts = waiter.effective_class && waiter.effective_class !== waiter.class
      ? waiter.class + " (as " + waiter.effective_class + ")" : waiter.class;
    const estimate = waiter.stopped ? "stopped"
      : (typeof waiter.estimate === "number" ? "about " + seconds(waiter.estimate) : "—");
    return row([waiter.position, counts, waiter.session || "—", waiter.pid,
      seconds(waiter.waited), estimate], [0, 3, 4]);
  });
}

function engineWords(engine, witness) {
  if (!engine) return "not looked at";
  let words = engine.url || "?";
  if (engine.problem) {
    words += ": " + engine.problem;
  } else {
    const of = typeof engine.slots === "number" ? " of " + engine.slots + " slots" : "";
    words += " (" + (engine.kind || "?") + "): " + engine.generating + of + " generating";
  }
  if (engine.unseen) {
    words += "; unseen: " + engine.unseen + " generation" + (engine.unseen === 1 ? "" : "s") +
      ", " + seconds(engine.unseen_seconds);
  } else if (engine.unseen === 0 && engine.witness) {
    words += "; unseen: none";
  }
  if (witness && witness.verdict) words += "; the witness sees it " + witness.verdict;
  return words;
}

function timeline(node, axis, hour) {
  const cells = (hour && hour.timeline) || [];
  node.replaceChildren(...cells.map((kind, minute) => {
    const cell = el("span", null, kind);
    cell.title = (60 - minute) + " min ago: " + kind;
    return cell;
  }));
  node.setAttribute("aria-label", "the last hour, a minute a cell: " +
    cells.filter((kind) => kind !== "idle").length + " minutes in use");
  axis.textContent = hour && hour.start
    ? new Date(hour.start * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"})
    : "";
}

function laneCard(lane, witness) {
  const card = document.getElementById("lane-template").content.firstElementChild.cloneNode(true);
  card.dataset.lane = lane.lane;
  card.querySelector(".name").textContent = lane.lane;
  const state = card.querySelector(".state");
  const held = lane.held_seats || (lane.state === "held" ? 1 : 0);
  state.textContent = lane.state + ((lane.seats || 1) > 1 ? " " + held + "/" + lane.seats : "");
  state.classList.add(lane.state);
  card.querySelector(".message").textContent = lane.message;
  fill(card.querySelector(".seats tbody"), seatRows(lane), "no seat", 5);
  fill(card.querySelector(".queue tbody"), queueRows(lane), "nobody waiting", 6);
  card.querySelector(".engine").textContent = engineWords(lane.engine, witness);
  const hour = lane.last_hour;
  timeline(card.querySelector(".timeline"), card.querySelector(".axis .from"), hour);
  const unseen = (hour && hour.unseen) || [];
  card.querySelector(".unseen-list").replaceChildren(...unseen.slice(-10).map((event) =>
    el("li", "unseen generation at " + new Date(event.ts * 1000).toLocaleTimeString() + ", " +
      seconds(event.duration) + (typeof event.tokens === "number" ? ", " + event.tokens +
      " tokens" : ""))));
  return card;
}

function sessionRows(sessions) {
  return Object.entries(sessions || {}).sort((a, b) => b[1].held - a[1].held).map(
    ([name, use]) => row([name, use.turns, use.local, seconds(use.held), use.deflected,
      use.busy, seconds(use.waited)], [1, 2, 3, 4, 5, 6]));
}

function shown(value) {
  if (value === null || value === undefined) return "—";
  return typeof value === "string" ? value : JSON.stringify(value);
}

function proxyFacts(proxy) {
  const facts = [["pid", proxy.pid], ["since", proxy.started], ["last reload", proxy.reloaded],
    ["requests in flight", proxy.in_flight], ["taking the lane", proxy.taking_the_lane],
    ["config files", (proxy.config_files || []).join(", ") || "none"]];
  const list = document.getElementById("proxy");
  list.replaceChildren();
  facts.forEach(([name, value]) => {
    list.appendChild(el("dt", name));
    list.appendChild(el("dd", shown(value)));
  });
  const settings = Object.entries(proxy.settings || {}).map(([name, setting]) =>
    row([name, shown(setting.value), setting.source]));
  fill(document.querySelector("#settings tbody"), settings, "not known", 3);
}

function draw(data) {
  const witness = data.proxy && data.proxy.witness;
  document.getElementById("lanes").replaceChildren(...data.lanes.map(
    (lane) => laneCard(lane, witness)));
  fill(document.querySelector("#sessions tbody"), sessionRows(data.sessions),
    "no turn in the last hour", 7);
  proxyFacts(data.proxy || {});
}

function say(trouble) {
  const node = document.getElementById("trouble");
  node.hidden = !trouble;
  node.textContent = trouble || "";
}

async function poll() {
  try {
    const answer = await fetch("status", {cache: "no-store", credentials: "same-origin"});
    if (!answer.ok) {
      say("the proxy answered " + answer.status + ": " + (await answer.text()).slice(0, 200));
    } else {
      draw(await answer.json());
      say(null);
      lastAnswer = Date.now();
    }
  } catch (error) {
    say("the proxy does not answer (" + error.message + "); trying again");
  }
  const live = document.getElementById("live");
  const age = Date.now() - lastAnswer;
  live.classList.toggle("stale", age > STALE);
  live.textContent = lastAnswer ? "live · updated " + new Date(lastAnswer).toLocaleTimeString()
    : "connecting…";
  setTimeout(poll, POLL);
}

poll();
