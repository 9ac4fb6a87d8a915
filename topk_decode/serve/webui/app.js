// topk serve's chat page: plain JavaScript, no dependencies, no requests to any host but the server.
// Model output is never parsed as HTML: the markdown renderer below builds DOM nodes and sets text only.
"use strict";

(() => {
  const STORE_KEY = "topk-webui.key";
  const STORE_CONVERSATIONS = "topk-webui.conversations";
  const STORE_CURRENT = "topk-webui.current";
  const $ = (id) => document.getElementById(id);

  const state = {
    key: readStored(STORE_KEY) || "",
    models: [], // GET /v1/models' data
    conversations: loadConversations(),
    current: readStored(STORE_CURRENT),
    controller: null, // the AbortController of the answer being streamed
    views: new WeakMap(), // message → its element
  };

  // ---- storage ----------------------------------------------------------------------------------
  function readStored(name) {
    try {
      return localStorage.getItem(name);
    } catch (e) {
      return null;
    }
  }

  function store(name, value) {
    try {
      if (value === null) localStorage.removeItem(name);
      else localStorage.setItem(name, value);
      return true;
    } catch (e) {
      notice("This browser would not keep the conversations (" + e.message + "): they last until the page closes.");
      return false;
    }
  }

  function loadConversations() {
    let list = [];
    try {
      list = JSON.parse(readStored(STORE_CONVERSATIONS) || "[]");
    } catch (e) {
      list = [];
    }
    if (!Array.isArray(list)) list = [];
    for (const c of list) {
      for (const m of c.messages || []) {
        if (m.pending) {
          m.pending = false;
          m.finish = m.finish || "interrupted";
        }
      }
    }
    return list.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages));
  }

  function save() {
    store(STORE_CONVERSATIONS, JSON.stringify(state.conversations));
    store(STORE_CURRENT, state.current);
  }

  // ---- the API ----------------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, error) {
      super((error && error.message) || "unknown error");
      this.status = status; // HTTP status; 0: the server could not be reached; null: an error inside a stream
      this.code = (error && error.code) || null;
    }
  }

  async function api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    if (state.key) headers.Authorization = "Bearer " + state.key;
    let response;
    try {
      response = await fetch(path, Object.assign({}, options, { headers, cache: "no-store" }));
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, { message: "no answer from " + location.origin + " (" + e.message + ")" });
    }
    if (!response.ok) {
      let error = null;
      try {
        error = (await response.json()).error;
      } catch (e) {
        error = null;
      }
      throw new ApiError(response.status, error || { message: response.status + " " + response.statusText });
    }
    return response;
  }

  // Run fn; on a 401, ask for the key (once per refusal) and run it again.
  async function withKey(fn) {
    for (;;) {
      try {
        return await fn();
      } catch (e) {
        if (!(e instanceof ApiError) || e.status !== 401) throw e;
        $("key-button").hidden = false;
        const given = await askForKey(state.key ? e.message : "");
        if (!given) throw e;
      }
    }
  }

  let keyWaiters = null;
  function askForKey(error) {
    const dialog = $("key-dialog");
    $("key-error").hidden = !error;
    $("key-error").textContent = error;
    $("key-forget").hidden = !state.key;
    $("key-input").value = "";
    if (!dialog.open) dialog.showModal();
    $("key-input").focus();
    return new Promise((resolve) => {
      keyWaiters = keyWaiters || [];
      keyWaiters.push(resolve);
    });
  }

  function keyAnswered(given) {
    const waiters = keyWaiters || [];
    keyWaiters = null;
    for (const resolve of waiters) resolve(given);
  }

  const LEADS = {
    0: "The server cannot be reached.",
    400: "The server could not take this request.",
    401: "The API key was refused.",
    404: "Not found.",
    413: "This is too long for the server.",
    429: "The server is busy: try again in a moment.",
    500: "The server failed on this request.",
    503: "The server is shutting down.",
  };

  // An error as people read it: a lead in plain words, then the server's own message.
  function errorBox(status, message) {
    const box = el("div", "error");
    box.setAttribute("role", "alert");
    const lead = status === null ? "The answer was cut off by the server." : LEADS[status] || "Error " + status + ".";
    box.append(el("strong", null, lead), el("span", null, message));
    return box;
  }

  // ---- models (the served caches) -------------------------------------------------------------------
  let modelsLoaded = Promise.resolve(); // the last loadModels(): a question sent before it ends waits for it

  function loadModels() {
    modelsLoaded = listModels();
    return modelsLoaded;
  }

  async function listModels() {
    const picker = $("model");
    try {
      const response = await withKey(() => api("/v1/models"));
      state.models = (await response.json()).data || [];
    } catch (e) {
      state.modelsError = errorText(e);
      notice(state.modelsError);
      return;
    }
    state.modelsError = "";
    picker.replaceChildren();
    for (const m of state.models) {
      const option = el("option", null, m.id);
      option.value = m.id;
      picker.append(option);
    }
    picker.disabled = state.models.length === 0;
    showConversation();
  }

  function modelInfo(id) {
    const m = state.models.find((x) => x.id === id);
    if (!m) return "";
    const n = (x) => Number(x).toLocaleString("en");
    const docs = m.documents === 1 ? "1 document" : n(m.documents) + " documents";
    return docs + " · " + n(m.context_tokens) + " tokens · strategy " + m.strategy;
  }

  function pickModel(id) {
    const picker = $("model");
    if (state.models.some((m) => m.id === id)) picker.value = id;
    $("model-info").textContent = modelInfo(picker.value);
  }

  // ---- conversations --------------------------------------------------------------------------------
  function currentConversation() {
    return state.conversations.find((c) => c.id === state.current) || null;
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function renderList() {
    const list = $("conversations");
    list.replaceChildren();
    const sorted = [...state.conversations].sort((a, b) => (b.updated || 0) - (a.updated || 0));
    for (const c of sorted) {
      const item = el("li");
      const open = el("button", "open", c.title || "New chat");
      open.type = "button";
      open.title = c.title || "";
      if (c.id === state.current) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => {
        if (state.controller) return;
        state.current = c.id;
        save();
        showConversation();
        $("prompt").focus();
      });
      const remove = el("button", "delete", "×");
      remove.type = "button";
      remove.setAttribute("aria-label", "Delete conversation: " + (c.title || "New chat"));
      remove.addEventListener("click", () => {
        if (state.controller && c.id === state.current) return;
        state.conversations = state.conversations.filter((x) => x !== c);
        if (state.current === c.id) state.current = null;
        save();
        showConversation();
        $("new-chat").focus();
      });
      item.append(open, remove);
      list.append(item);
    }
  }

  function showConversation() {
    const conv = currentConversation();
    if (conv && conv.model) {
      pickModel(conv.model);
      if (state.models.length && !state.models.some((m) => m.id === conv.model)) {
        notice("This conversation's cache '" + conv.model + "' is not served now: questions go to '" + $("model").value + "'.");
      } else notice("");
    } else pickModel($("model").value);
    const box = $("messages");
    box.replaceChildren();
    const messages = conv ? conv.messages : [];
    if (!messages.length) {
      const empty = el("div", "empty");
      empty.append(
        el(
          "p",
          null,
          "Ask a question about the documents of the cache picked above. Each answer names the documents it drew on; open one to read the passage."
        )
      );
      box.append(empty);
    }
    for (const m of messages) box.append(messageView(m));
    box.scrollTop = box.scrollHeight;
    renderList();
  }

  function messageView(m) {
    const article = el("article", "msg " + (m.role === "user" ? "user" : "assistant"));
    const who = m.role === "user" ? "You" : "Answer" + (m.model ? " · " + m.model : "");
    article.append(el("h3", null, who), el("div", "content"));
    state.views.set(m, article);
    updateView(m);
    return article;
  }

  function updateView(m) {
    const article = state.views.get(m);
    if (!article) return;
    const content = article.querySelector(".content");
    if (m.role === "user") {
      content.replaceChildren(...m.content.split("\n").flatMap((line, i) => (i ? [el("br"), line] : [line])));
      return;
    }
    content.replaceChildren(renderMarkdown(m.content || ""));
    content.classList.toggle("typing", !!m.pending);
    article.setAttribute("aria-busy", m.pending ? "true" : "false");
    for (const old of article.querySelectorAll(":scope > .sources, :scope > .status, :scope > .error")) old.remove();
    if (m.sources && m.sources.length) article.append(sourcesView(m));
    const status = {
      stopped: "Stopped.",
      length: "Cut off at the length limit (max_tokens).",
      interrupted: "The page closed before this answer ended.",
    }[m.finish];
    if (status) article.append(el("p", "status", status));
    if (m.error) article.append(errorBox(m.error.status, m.error.message));
  }

  // ---- sources and their passages --------------------------------------------------------------------
  function citation(s) {
    return s.place ? s.document + " " + s.place : s.document;
  }

  function sourcesView(m) {
    const box = el("div", "sources");
    box.append(el("h4", null, "Sources"));
    const list = el("ul");
    for (const s of m.sources) {
      const item = el("li");
      const button = el("button", null, citation(s));
      button.type = "button";
      button.append(el("span", "share", Math.round(s.weight * 100) + "%"));
      button.title = "Open the passage";
      button.addEventListener("click", () => openPassage(m.model, s));
      item.append(button);
      list.append(item);
    }
    box.append(list);
    return box;
  }

  async function openPassage(model, source) {
    const dialog = $("passage-dialog");
    const text = $("passage-text");
    $("passage-title").textContent = citation(source);
    $("passage-meta").textContent = "Loading the passage…";
    text.replaceChildren();
    if (!dialog.open) dialog.showModal();
    $("passage-close").focus();
    const query = new URLSearchParams({ model: model || $("model").value, document: source.document });
    if (Array.isArray(source.span)) {
      query.set("start", source.span[0]);
      query.set("end", source.span[1]);
    }
    try {
      const response = await withKey(() => api("/v1/passage?" + query.toString()));
      const p = await response.json();
      $("passage-title").textContent = p.place ? p.document + " " + p.place : p.document;
      $("passage-meta").textContent =
        Math.round(source.weight * 100) +
        "% of the answer's retrieved attention · the marked passage drew the most of it (context tokens " +
        p.start.toLocaleString("en") +
        "–" +
        p.end.toLocaleString("en") +
        " of " +
        query.get("model") +
        ")";
      const mark = el("mark", null, p.text);
      text.append(p.document_start ? "" : "…", p.before, mark, p.after, p.document_end ? "" : "…");
      mark.scrollIntoView({ block: "center" });
    } catch (e) {
      $("passage-meta").textContent = "";
      text.append(errorBox(e.status === undefined ? 0 : e.status, e.message));
    }
  }

  // ---- asking -----------------------------------------------------------------------------------------
  function history(conv, upTo) {
    const out = [];
    for (const m of conv.messages.slice(0, upTo)) {
      if (m.role === "user") out.push({ role: "user", content: m.content });
      else if (m.content) out.push({ role: "assistant", content: m.content });
    }
    return out;
  }

  async function send(question) {
    let conv = currentConversation();
    const model = $("model").value;
    if (!conv) {
      conv = { id: newId(), title: "", model, messages: [], updated: Date.now() };
      state.conversations.push(conv);
      state.current = conv.id;
    }
    conv.model = model;
    conv.title = conv.title || question.replace(/\s+/g, " ").trim().slice(0, 60);
    conv.updated = Date.now();
    conv.messages.push({ role: "user", content: question });
    const answer = { role: "assistant", content: "", model, pending: true };
    conv.messages.push(answer);
    const messages = history(conv, conv.messages.length - 1);
    save();
    showConversation();
    setBusy(true);
    const controller = new AbortController();
    state.controller = controller;
    let frame = 0;
    const redraw = () => {
      if (!frame)
        frame = requestAnimationFrame(() => {
          frame = 0;
          updateView(answer);
          const box = $("messages");
          box.scrollTop = box.scrollHeight;
        });
    };
    try {
      const body = JSON.stringify({ model, stream: true, messages });
      const response = await withKey(() =>
        api("/v1/chat/completions", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body,
          signal: controller.signal,
        })
      );
      await readStream(response, answer, redraw);
    } catch (e) {
      if (e.name === "AbortError") answer.finish = "stopped";
      else answer.error = { status: e.status === undefined ? 0 : e.status, message: e.message };
    } finally {
      if (frame) cancelAnimationFrame(frame);
      answer.pending = false;
      state.controller = null;
      conv.updated = Date.now();
      save();
      updateView(answer);
      renderList();
      setBusy(false);
    }
  }

  // OpenAI's server-sent events: content deltas, then a chunk with finish_reason and sources, then [DONE].
  async function readStream(response, answer, redraw) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(null, chunk.error);
        const choice = (chunk.choices || [])[0];
        if (choice && choice.delta && choice.delta.content) answer.content += choice.delta.content;
        if (choice && choice.finish_reason) answer.finish = choice.finish_reason;
        if (chunk.sources) answer.sources = chunk.sources;
        redraw();
      }
    }
  }

  function setBusy(busy) {
    const stopHadFocus = document.activeElement === $("stop");
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("model").disabled = busy || state.models.length === 0;
    $("new-chat").disabled = busy;
    if (!busy && stopHadFocus) $("prompt").focus();
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  // ---- markdown ---------------------------------------------------------------------------------------
  // A small renderer for what models write: headings, paragraphs, lists, block quotes, fenced code, tables,
  // rules; inline code, bold, italics, strike-through, links (http, https and mailto only; images become
  // links, never loaded). Everything becomes element nodes and text nodes: no HTML is ever parsed.
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$/;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function startsBlock(line, next) {
    return (
      FENCE.test(line) ||
      HEADING.test(line) ||
      RULE.test(line) ||
      QUOTE.test(line) ||
      ITEM.test(line) ||
      (line.includes("|") && next !== undefined && TABLE_RULE.test(next))
    );
  }

  function renderMarkdown(source) {
    const out = document.createDocumentFragment();
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const close = new RegExp("^ {0,3}" + m[1][0] + "{" + m[1].length + ",}\\s*$");
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++; // the closing fence (or the end of an answer still streaming)
        out.append(codeBlock(body.join("\n"), m[2]));
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        const h = el("h" + Math.min(6, m[1].length + 2)); // below the page's own h1 to h3
        inline(m[2], h);
        out.append(h);
        i++;
      } else if (RULE.test(line)) {
        out.append(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const body = [];
        for (; i < lines.length && QUOTE.test(lines[i]); i++) body.push(lines[i].replace(QUOTE, ""));
        const quote = el("blockquote");
        quote.append(renderMarkdown(body.join("\n")));
        out.append(quote);
      } else if (ITEM.test(line)) {
        i = list(lines, i, out);
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
        i = table(lines, i, out);
      } else {
        const p = el("p");
        let first = true;
        for (; i < lines.length && lines[i].trim() && (first || !startsBlock(lines[i], lines[i + 1])); i++) {
          if (!first) p.append(el("br"));
          inline(lines[i].trim(), p);
          first = false;
        }
        out.append(p);
      }
    }
    return out;
  }

  function list(lines, i, out) {
    const first = ITEM.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const node = el(ordered ? "ol" : "ul");
    if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
    const indent = first[1].length;
    let item = null;
    for (; i < lines.length; i++) {
      const line = lines[i];
      const m = ITEM.exec(line);
      if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
        item = { lines: [m[3]] };
        node.append((item.node = el("li")));
        item.node.itemLines = item.lines;
      } else if (!line.trim()) {
        const next = lines[i + 1];
        if (next === undefined || !(/^\s{2,}/.test(next) || (ITEM.exec(next) || [])[1] !== undefined)) break;
        item.lines.push("");
      } else if (/^\s{2,}/.test(line) || (!m && !startsBlock(line, lines[i + 1]))) {
        item.lines.push(line.replace(/^\s{1,4}/, ""));
      } else break;
    }
    for (const li of node.children) {
      const text = li.itemLines.join("\n").replace(/\n+$/, "");
      if (text.includes("\n")) li.append(renderMarkdown(text));
      else inline(text, li);
    }
    out.append(node);
    return i;
  }

  function cells(line) {
    return line
      .trim()
      .replace(/^\|/, "")
      .replace(/\|$/, "")
      .split("|")
      .map((c) => c.trim());
  }

  function tableRow(line, tag) {
    const tr = el("tr");
    for (const c of cells(line)) {
      const cell = el(tag);
      inline(c, cell);
      tr.append(cell);
    }
    return tr;
  }

  function table(lines, i, out) {
    const node = el("table");
    const head = el("thead");
    head.append(tableRow(lines[i], "th"));
    node.append(head);
    const body = el("tbody");
    for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
      body.append(tableRow(lines[i], "td"));
    }
    node.append(body);
    out.append(node);
    return i;
  }

  function codeBlock(text, lang) {
    const box = el("div", "code");
    const head = el("div", "code-head");
    const copy = el("button", null, "Copy");
    copy.type = "button";
    copy.setAttribute("aria-label", "Copy the code" + (lang ? " (" + lang + ")" : ""));
    copy.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(text);
        copy.textContent = "Copied";
      } catch (e) {
        const range = document.createRange();
        range.selectNodeContents(code);
        getSelection().removeAllRanges();
        getSelection().addRange(range);
        copy.textContent = "Selected: press Ctrl+C";
      }
    });
    head.append(el("span", null, lang || "code"), copy);
    const pre = el("pre");
    const code = el("code", null, text);
    if (lang) code.className = "language-" + lang.replace(/[^\w+#.-]/g, "");
    pre.append(code);
    box.append(head, pre);
    return box;
  }

  const INLINE =
    /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|~~(?=\S)([\s\S]*?\S)~~|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])|(!?)\[([^\]\n]*)\]\(\s*<?([^\s)<>]+)>?(?:\s+"[^"\n]*")?\s*\)/g;

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      last = m.index + m[0].length;
      if (m[1]) parent.append(el("code", null, m[2].replace(/^ (.*) $/, "$1")));
      else if (m[3] !== undefined || m[4] !== undefined) wrap("strong", m[3] !== undefined ? m[3] : m[4], parent);
      else if (m[5] !== undefined) wrap("del", m[5], parent);
      else if (m[6] !== undefined || m[7] !== undefined) wrap("em", m[6] !== undefined ? m[6] : m[7], parent);
      else link(m[8] === "!", m[9], m[10], parent);
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  function wrap(tag, text, parent) {
    const node = el(tag);
    inline(text, node);
    parent.append(node);
  }

  function link(image, label, url, parent) {
    if (!/^(https?:\/\/|mailto:)/i.test(url)) {
      parent.append(label ? label + " (" + url + ")" : url);
      return;
    }
    const a = el("a");
    a.href = url;
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    if (image) a.textContent = "image: " + (label || url);
    else inline(label || url, a);
    parent.append(a);
  }

  // ---- page -------------------------------------------------------------------------------------------
  function notice(text) {
    $("notice").textContent = text;
    $("notice").hidden = !text;
  }

  function errorText(e) {
    if (!(e instanceof ApiError)) return String(e);
    const lead = LEADS[e.status] || "Error " + e.status + ".";
    return lead + " " + e.message;
  }

  function start() {
    let submitting = false;
    $("ask").addEventListener("submit", async (event) => {
      event.preventDefault();
      if (submitting || state.controller || !$("prompt").value.trim()) return;
      submitting = true;
      try {
        if (!$("model").value) await modelsLoaded; // sent before the caches were listed: once they are
        if (!$("model").value) {
          notice("There is no cache to ask. " + (state.modelsError || "The server lists none."));
          return;
        }
        const question = $("prompt").value;
        $("prompt").value = "";
        send(question);
      } finally {
        submitting = false;
      }
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("ask").requestSubmit();
      } else if (event.key === "Escape" && state.controller) {
        stop();
      }
    });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => {
      state.current = null;
      save();
      showConversation();
      $("prompt").focus();
    });
    $("model").addEventListener("change", () => {
      const conv = currentConversation();
      if (conv) {
        conv.model = $("model").value;
        save();
      }
      notice("");
      pickModel($("model").value);
    });
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      state.key = key;
      store(STORE_KEY, key);
      $("key-dialog").close();
      keyAnswered(true); // the requests waiting for a key are sent again
    });
    $("key-forget").addEventListener("click", () => {
      state.key = "";
      store(STORE_KEY, null);
      $("key-forget").hidden = true;
      $("key-input").focus();
    });
    $("key-cancel").addEventListener("click", () => $("key-dialog").close());
    $("key-dialog").addEventListener("close", () => keyAnswered(false));
    $("key-button").addEventListener("click", () => {
      askForKey("").then((given) => given && !state.models.length && loadModels());
    });
    $("passage-close").addEventListener("click", () => $("passage-dialog").close());
    if (state.key) $("key-button").hidden = false;
    showConversation();
    loadModels();
    $("prompt").focus();
  }

  start();
})();
