// Tessera console: the only script besides htmx. Copy buttons: <button data-copy="#id">.
"use strict";
document.addEventListener("click", async (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source) return;
  const text = source.textContent.trim();
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API (plain http on another host): select the text for Ctrl+C instead.
    const range = document.createRange();
    range.selectNodeContents(source);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});

// A key was created: empty the form so the next key starts from a clean slate.
document.addEventListener("htmx:afterRequest", (event) => {
  const form = event.detail.elt;
  if (form && form.id === "create-key" && event.detail.successful) form.reset();
});
